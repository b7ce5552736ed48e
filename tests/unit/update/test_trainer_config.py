"""DeepSpeed configs: a frozen model (the reference) gets a stage DeepSpeed accepts without an
optimizer, whatever stage the trainer uses."""
import pytest

from update.config import TrainerConfig
from update.trainer import ds_config


@pytest.mark.parametrize("stage, frozen_stage", [(1, 0), (2, 0), (3, 3)])
def test_reference_model_stage(stage, frozen_stage):
    cfg = TrainerConfig(zero_stage=stage)
    assert ds_config(cfg, 2, 1)["zero_optimization"]["stage"] == stage
    frozen = ds_config(cfg, 2, 1, train=False)
    assert frozen["zero_optimization"]["stage"] == frozen_stage
    assert "gradient_clipping" not in frozen


@pytest.mark.parametrize("dtype, mode, bf16, autocast", [
    ("float32", "weights", False, False), ("float32", "autocast", False, False),
    ("bfloat16", "weights", True, False), ("bfloat16", "autocast", False, True)])
def test_bf16_modes(dtype, mode, bf16, autocast):
    """bf16 weights (DeepSpeed bf16, fp32 master) or fp32 weights under torch.autocast."""
    config = ds_config(TrainerConfig(dtype=dtype, bf16_mode=mode), 1, 1)
    assert config["bf16"]["enabled"] is bf16
    assert config["torch_autocast"]["enabled"] is autocast
