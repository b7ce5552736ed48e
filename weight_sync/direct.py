"""Copy synced tensors straight into an engine's own parameters, each at its slot.

vLLM's layerwise reload (checkpoint format) rebuilds every layer: fresh tensors, its loaders,
then the platform's processing. On CPU that processing re-packs each linear weight for oneDNN,
and a reload of a 100M model cost about 5x a memcpy of its bytes here. When the engine keeps
its weights in checkpoint layout (vLLM on GPU; vLLM-CPU with `rollout.cpu_linear: repack` or
`plain`), a sync only has to put each tensor where vLLM's loader would: q/k/v rows in the fused
`qkv_proj`, gate/up rows in `gate_up_proj`, the vocab rows of the padded embedding
(`weight_sync.resharding.local_param_slot`). One copy per tensor, into the same storage (CUDA
graphs and captured pointers stay valid).

The same placement serves a tensor-parallel rank fed `shard_for_rank` slices (tp_rank > 0).
Only unquantized Qwen2/Llama-family names are known; other models load through vLLM's reload.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from weight_sync.resharding import TPSpec, local_param_slot, sent_rows

# model_type values of the architectures whose names resharding's rules cover
DIRECT_MODEL_TYPES = ("qwen2", "llama")
RELOAD_HINT = "load this model through vLLM's reload instead (rollout.cpu_linear=packed on CPU)"


class DirectLoadError(ValueError):
    """A tensor that has no place in the engine, or an engine parameter the sync left unset."""


class DirectLoad:
    """`load(iterator of (HF name, tensor))` into `params` (the engine's tensors by vLLM name,
    aliases included, e.g. a tied `lm_head.weight`); every parameter must be filled each call.
    Names that share storage (a tied head) are one parameter: filled once, by either name."""

    def __init__(self, params: Mapping[str, torch.Tensor], spec: TPSpec, tp_rank: int = 0):
        self.params, self.spec, self.tp_rank = dict(params), spec, tp_rank
        self._unique: dict[int, str] = {}  # storage -> its first name
        for name, p in self.params.items():
            self._unique.setdefault(p.data_ptr(), name)

    @staticmethod
    def supports(model_type: str) -> bool:
        return model_type in DIRECT_MODEL_TYPES

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        filled: dict[int, dict[int, int]] = {}  # storage -> {row offset: rows}
        with torch.no_grad():
            for name, tensor in weights:
                self.place(name, tensor, filled)
        self.check_complete(filled)

    def place(self, name: str, tensor: torch.Tensor, filled: dict[int, dict[int, int]]) -> int:
        """Copy one tensor to its slot, noting it in `filled` (storage -> {row offset: rows});
        returns the elements copied (0 for the other name of a tied head: same rows)."""
        target, offset = local_param_slot(name, self.spec)
        param = self.params.get(target)
        if param is None:
            raise DirectLoadError(f"{name!r} goes to engine parameter {target!r}, which "
                                  f"the engine does not have; {RELOAD_HINT}")
        rows = tensor.shape[0] if tensor.dim() else 1
        if tensor.shape[1:] != param.shape[1:] or offset + rows > param.shape[0]:
            raise DirectLoadError(
                f"{name!r} {tuple(tensor.shape)} does not fit rows [{offset}, "
                f"{offset + rows}) of engine parameter {target!r} "
                f"{tuple(param.shape)}: the engine was built from another model config")
        done = filled.setdefault(param.data_ptr(), {})
        if offset in done:  # the other name of a tied head: same storage, same rows
            return 0
        param.narrow(0, offset, rows).copy_(tensor)
        done[offset] = rows
        return tensor.numel()

    def check_complete(self, filled: dict[int, dict[int, int]]) -> None:
        missing = []
        for key, name in self._unique.items():
            param = self.params[name]
            want = sent_rows(name, param.shape[0] if param.dim() else 1, self.spec, self.tp_rank)
            got = sum(filled.get(key, {}).values())
            if got < want:
                missing.append(f"{name} ({got}/{want} rows)")
        if missing:
            raise DirectLoadError(
                f"the sync left {len(missing)} engine parameter(s) unset: "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; the trainer must "
                f"send every weight (a tied lm_head explicitly)")
