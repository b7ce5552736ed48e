"""The tolerance rules of tests/numerics.py hold where an exact answer is known: a float32
forward of the test models against the same forward in float64 (one side's rounding: half the
two-sided bound), and the bound shrinks with the dtype's unit roundoff."""
import pytest
import torch

from tests.numerics import adam_update, depth, rounding, width


@pytest.mark.parametrize("preset", ["tiny-qwen2", "small-qwen2"])
def test_a_float32_forward_is_within_half_the_rounding_bound_of_float64(preset, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl.data.models import build_tiny_model

    path = build_tiny_model(preset, out_dir=tmp_path / "m")
    out = {}
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        ids = torch.randint(3, model.config.vocab_size, (4, 48),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out[dtype] = model(ids).logits.log_softmax(-1).double()
    error = float((out[torch.float32] - out[torch.float64]).abs().max())
    config = model.config
    bound = rounding(float(out[torch.float64].abs().max()), depth(config), width(config)) / 2
    assert 0 < error <= bound, (error, bound)


def test_the_bounds_scale_with_the_unit_roundoff():
    assert rounding(1.0, 3, 384, "bfloat16") == rounding(1.0, 3, 384) * 2 ** 16
    assert adam_update(3, 384, "bfloat16") == adam_update(3, 384) * 2 ** 8
