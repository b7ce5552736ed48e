"""update.mlp: the gated MLP through SiluMul computes autograd's values and gradients bit for
bit, and keeps one [T, I] tensor fewer for the backward."""
import copy

import pytest
import torch

from update.mlp import SiluMul, lean_gated_mlps


def small_llama():
    from transformers import LlamaConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def test_a_lean_model_scores_and_trains_exactly_as_the_model():
    model = small_llama()
    lean = copy.deepcopy(model)
    assert lean_gated_mlps(lean) == 2
    ids = torch.randint(0, 128, (3, 9))
    grads = []
    for m in (model, lean):
        logits = m(input_ids=ids).logits
        (logits.float() ** 2).mean().backward()
        grads.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (a, ga), (b, gb) = grads
    assert torch.equal(a, b)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("lean", [False, True])
def test_the_lean_mlp_keeps_one_tensor_of_its_width_fewer(lean):
    mlp = small_llama().model.layers[0].mlp
    if lean:
        lean_gated_mlps(mlp)
    x = torch.randn(5, 32, requires_grad=True)
    widths = []

    def pack(t):
        if t.dim() == 2 and t.shape == (5, 96):  # activations of the width, not weights
            widths.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    # gate, silu(gate), up and the product (down's input); lean: gate, up and the product
    assert len(set(widths)) == (3 if lean else 4)


def test_silu_mul_gradcheck():
    gate = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SiluMul.apply, (gate, up))
