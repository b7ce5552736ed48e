"""DeepSpeed configs: a frozen model (the reference) gets a stage DeepSpeed accepts without an
optimizer, whatever stage the trainer uses."""
from types import SimpleNamespace

import pytest

from update.config import TrainerConfig
from update.zero import ds_config


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


def _small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        vocab_size=100, tie_word_embeddings=False))


def test_zero3_gathers_whole_within_the_bound_or_on_one_rank_else_releases_layer_by_layer():
    """Within zero3_whole_model_max, or on one rank, a model is gathered whole (no release
    settings); above it on several ranks, or with the key 0, module by module with each module
    released once used, prefetch and reduce buffers of one decoder layer; release off:
    DeepSpeed's defaults. DeepSpeed's process-wide memory-efficient linear is never on."""
    from update.zero import is_whole, release_unit

    model = _small_model()
    n = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert layer < n < TrainerConfig().zero3_whole_model_max
    for cfg, world, whole, unit in [
            (TrainerConfig(zero3_whole_model_max=n), 2, True, None),
            (TrainerConfig(zero3_whole_model_max=n - 1), 2, False, layer),
            (TrainerConfig(zero3_whole_model_max=n - 1), 1, True, None),
            (TrainerConfig(zero3_whole_model_max=0), 1, False, layer),
            (TrainerConfig(zero3_whole_model_max=0, zero3_release_params=False), 2, False, None),
            (TrainerConfig(zero_stage=2, zero3_whole_model_max=0), 2, False, None)]:
        assert (is_whole(model, cfg, world), release_unit(model, cfg, world)) == (whole, unit), cfg
        zero = ds_config(cfg, 2, 1, release_unit=unit)["zero_optimization"]
        assert zero["memory_efficient_linear"] is False  # process-wide: zero3_linears
        if unit is None:
            assert "stage3_max_reuse_distance" not in zero
        else:
            assert zero["stage3_max_reuse_distance"] == 0
            assert zero["stage3_prefetch_bucket_size"] == zero["reduce_bucket_size"] == layer


def test_decoder_linears_save_the_weight_not_its_view_and_compute_the_same():
    """Released module by module, each decoder layer's linear saves the weight Parameter for
    its backward (DeepSpeed's ZeRO-3 linear), not torch's view W.t() that would hold the
    gathered weight; the head and torch.nn.functional.linear stay torch's; same numbers."""
    import torch
    import torch.nn.functional as F

    from tests.numerics import depth, rounding, width
    from update.zero import zero3_linears

    torch.manual_seed(0)
    model, ids = _small_model(), torch.randint(0, 100, (2, 7))
    with torch.no_grad():  # HF starts biases at 0: nonzero ones, so that a lost bias shows
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    before = model(ids).logits
    before.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    linear = F.linear
    zero3_linears(model)
    assert F.linear is linear and "forward" not in vars(model.lm_head)
    q_proj = model.model.layers[0].self_attn.q_proj
    out = q_proj(torch.randn(3, 32, requires_grad=True))
    assert type(out.grad_fn).__name__ == "LinearFunctionForZeroStage3Backward"
    after = model(ids).logits
    after.sum().backward()
    # DeepSpeed's linear (a matmul, then the bias) rounds otherwise than torch's addmm
    layers, terms = depth(model.config), width(model.config)
    assert float((after - before).abs().max()) <= rounding(float(before.abs().max()), layers, terms)
    for n, p in model.named_parameters():  # the backward: the forward's depth again
        bound = rounding(float(grads[n].abs().max()), 2 * layers, terms)
        assert float((p.grad - grads[n]).abs().max()) <= bound, n


@pytest.mark.parametrize("preset, whole", [("tiny-qwen2", True), ("small-qwen2", True),
                                            ("bench-100m", False)])
def test_the_default_bound_gathers_small_models_whole_and_bench_100m_by_module(preset, whole):
    """By default the quickstart's models are gathered whole (its speed) and bench-100m on 2
    ranks module by module (ZeRO-3 below ZeRO-2's peak: benchmarks/update_zero.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl.data.models import PRESETS, _model_config
    from update.zero import is_whole

    p = PRESETS[preset]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_model_config(
            p, p.vocab_size, SimpleNamespace(eos_token_id=1, pad_token_id=0)))
    assert is_whole(model, TrainerConfig(), 2) is whole
    assert is_whole(model, TrainerConfig(), 1)


def test_gradient_checkpointing_is_auto_by_default_and_unresolved_auto_does_not_recompute():
    """rl-train settles auto from its plan (rl.plan.plan.choose_checkpointing); the update
    package alone reads auto as false; a set value wins, with LoRA too."""
    from update.config import LoraConfig

    assert TrainerConfig().gradient_checkpointing == "auto"
    assert TrainerConfig().checkpointing() is False
    assert TrainerConfig(lora=LoraConfig()).checkpointing() is False
    assert TrainerConfig(lora=LoraConfig(), gradient_checkpointing=True).checkpointing() is True
    assert TrainerConfig(gradient_checkpointing=False).checkpointing() is False
