"""update.lora on a small HF model: the merge equals PEFT's own merge_and_unload, the adapter
files load with `peft` as the same adapted model, and target_modules are checked without
weights."""
import copy

import pytest
import torch

from tests.numerics import depth, rounding, width
from update.config import LoraConfig
from update.lora import (adapter_config, add_adapters, base_name, check_targets, merged,
                         plain_model, scale, write_adapter)


@pytest.fixture
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def _trained(model, cfg):
    """The model with adapters whose B is no longer zero (as after training)."""
    peft = add_adapters(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.1)
    return peft


def _logits(model, ids=torch.arange(3, 20)[None]):
    with torch.no_grad():
        return model(ids).logits


def test_the_merge_equals_peft_and_the_adapted_model(model):
    cfg = LoraConfig(rank=4, alpha=8.0)
    base = copy.deepcopy(model)
    peft = _trained(model, cfg)
    full = {n: p.detach() for n, p in model.named_parameters()}
    ours = merged(full, scale(cfg))
    theirs = copy.deepcopy(peft).merge_and_unload().state_dict()
    assert set(ours) <= set(theirs) and "model.layers.0.self_attn.q_proj.weight" in ours
    for name, w in ours.items():  # W + s·BA: a sum of rank terms, rounded in another order
        assert float((w - theirs[name]).abs().max()) <= rounding(
            float(w.abs().max()), 1, cfg.rank), name
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"],
                           base.state_dict()["model.layers.0.mlp.down_proj.weight"])
    plain = plain_model(model.config, ours, dict(model.named_buffers()))
    adapted = _logits(model)  # merged weights: one more rounding in each layer's weights
    assert float((_logits(plain) - adapted).abs().max()) <= rounding(
        float(adapted.abs().max()), depth(model.config) + model.config.num_hidden_layers,
        width(model.config))
    with peft.disable_adapter():  # the adapter off: the base model
        assert torch.equal(_logits(model), _logits(base))


def test_the_adapter_files_load_with_peft(model, tmp_path):
    from peft import PeftModel

    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    base = copy.deepcopy(model)
    _trained(model, cfg)
    adapter = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert adapter and all(".q_proj." in n or ".v_proj." in n for n in adapter)
    nbytes = write_adapter(tmp_path, adapter, adapter_config(cfg, "base"))
    assert nbytes == sum(p.numel() * 4 for p in adapter.values())
    loaded = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    assert torch.equal(_logits(loaded), _logits(model))  # the same weights, the same code


def test_targets_are_checked_on_the_meta_device(model):
    check_targets(model.config, LoraConfig(target_modules=["q_proj", "down_proj"]))
    with pytest.raises(ValueError, match="q_proj"):  # the error lists the model's linears
        check_targets(model.config, LoraConfig(target_modules=["query"]))
    # no linear layer inside the model: the merge and vLLM take those only, and a head tied to
    # the embeddings would drop its adapter when the merged model ties them again
    for outside in ("embed_tokens", "lm_head"):
        with pytest.raises(ValueError, match=f"{outside}, which take no adapter"):
            check_targets(model.config, LoraConfig(target_modules=[outside, "q_proj"]))


def test_names():
    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_adapters_are_drawn_from_the_seed_alone(model):
    def a_weights(seed, process_seed):
        m = copy.deepcopy(model)
        torch.manual_seed(process_seed)  # the process's own random state plays no part
        add_adapters(m, LoraConfig(rank=4), seed)
        return {n: p.clone() for n, p in m.named_parameters() if ".lora_A." in n}

    first, again, other = a_weights(0, 5), a_weights(0, 6), a_weights(1, 5)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(not torch.equal(first[n], other[n]) for n in first)


def test_merged_weights_that_do_not_fit_the_model_name_the_way_around(model):
    weights = dict(model.state_dict())
    del weights["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"missing \['model.norm.weight'\].*sync.lora=adapters"):
        plain_model(model.config, weights, {})
