"""The gated MLP of Llama-family models (down(silu(gate(x)) * up(x))) with one [T, I] tensor
fewer kept for the backward, on the same numbers.

Autograd keeps gate(x) for silu's backward, and silu(gate) and up(x) for the product's: three
tensors of the MLP's width a token and layer. SiluMul keeps gate and up and recomputes silu in
the backward (an elementwise op), with the same aten kernels as autograd's, so the values and
the gradients are the same bit for bit (tests/unit/update/test_mlp.py). Beside the down
projection's input, which it keeps either way, the MLP then holds 3I instead of 4I elements a
token and layer (Liger's SwiGLU does the same in a Triton kernel).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


def is_silu_gated(module: torch.nn.Module) -> bool:
    """A Llama-style MLP: gate_proj, up_proj, down_proj and a SiLU between."""
    act = getattr(module, "act_fn", None)
    return (all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def lean_gated_mlps(model: torch.nn.Module) -> int:
    """Run every SiLU-gated MLP of the model through SiluMul (its forward replaced on the
    instance: hooks, PEFT adapters and ZeRO-3 see the same submodule calls); how many."""
    count = 0
    for m in model.modules():
        if is_silu_gated(m):
            m.forward = types.MethodType(_gated_forward, m)
            count += 1
    return count
