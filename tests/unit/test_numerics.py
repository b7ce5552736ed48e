"""The tolerance rules of tests/numerics.py hold where an exact answer is known: a float32
forward of the test models against the same forward in float64 (one side's rounding: half the
two-sided bound), and the bound shrinks with the dtype's unit roundoff."""
import pytest
import torch

from tests.numerics import adam_update, depth, rounding, width


@pytest.mark.parametrize("preset", ["tiny-qwen2", "small-qwen2"])
def test_a_float32_forward_is_within_half_the_rounding_bound_of_float64(preset):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl.data.models import PRESETS

    p = PRESETS[preset]  # the preset's shape with random weights (no tokenizer needed)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads, tie_word_embeddings=p.tie_word_embeddings)).eval()
    ids = torch.randint(3, p.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            out[dtype] = model.to(dtype)(ids).logits.log_softmax(-1).double()
    error = float((out[torch.float32] - out[torch.float64]).abs().max())
    bound = rounding(float(out[torch.float64].abs().max()), depth(model.config),
                     width(model.config)) / 2
    assert 0 < error <= bound, (error, bound)


def test_the_bounds_scale_with_the_unit_roundoff():
    assert rounding(1.0, 3, 384, "bfloat16") == rounding(1.0, 3, 384) * 2 ** 16
    assert adam_update(3, 384, "bfloat16") == adam_update(3, 384) * 2 ** 8
