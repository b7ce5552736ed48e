"""The planner's formulas against hand-computed tables: model states per ZeRO stage (the ZeRO
paper's 7.5B example), parameters and KV bytes of known models (MHA and GQA), TP division."""
import pytest

from rl.plan.memory import (EngineSide, TrainerSide, engine_memory, kv_bytes_per_token_per_rank,
                            state_bytes)
from rl.plan.shape import ModelShape

# Llama-2-7B (MHA) and Llama-3-8B (GQA), from their config.json
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                 vocab_size=32000, tie_word_embeddings=False)
LLAMA3_8B = dict(LLAMA2_7B, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)


def side(stage, ranks, dtype="bfloat16"):
    return TrainerSide(ranks=ranks, zero_stage=stage, dtype=dtype, bf16_mode="weights",
                       micro_batch=1, prompt_tokens=1, response_tokens=1, group_size=1,
                       share_prompts=False, checkpointing=False, whole_model_max=0, release=True,
                       reference=False, critic=False)


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_papers_example(stage, gb):
    """Rajbhandari et al. 2020, figure 1: Φ = 7.5B, K = 12 (mixed-precision Adam), 64 devices:
    120 / 31.4 / 16.6 / 1.9 GB per device."""
    assert sum(state_bytes(7.5e9, side(stage, 64)).values()) / 1e9 == pytest.approx(gb, abs=0.05)


def test_float32_states_are_16_bytes_without_a_master_copy():
    # 4 weights + 4 gradients + 8 Adam, ZeRO-2 on 4 ranks: 4Φ + 12Φ/4
    assert sum(state_bytes(1e9, side(2, 4, "float32")).values()) == pytest.approx(7e9)


def test_parameter_counts_of_known_models():
    assert ModelShape.from_config(LLAMA2_7B).params() == 6_738_415_616  # "7B"
    assert ModelShape.from_config(LLAMA3_8B).params() == 8_030_261_248  # "8B"
    qwen = ModelShape.from_config(dict(  # Qwen2-0.5B: q/k/v biases, tied head
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        tie_word_embeddings=True))
    assert qwen.params() == 494_032_768


@pytest.mark.parametrize("config, tp, per_token", [
    (LLAMA2_7B, 1, 2 * 32 * 32 * 128 * 2),   # MHA: 512 KiB a token in bf16
    (LLAMA3_8B, 1, 2 * 32 * 8 * 128 * 2),    # GQA: 128 KiB
    (LLAMA3_8B, 4, 2 * 32 * 2 * 128 * 2),    # 8 KV heads over 4 ranks: 2 each
    (LLAMA3_8B, 16, 2 * 32 * 1 * 128 * 2),   # more ranks than KV heads: one each (replicated)
])
def test_kv_bytes_per_token_and_tp_rank(config, tp, per_token):
    shape = ModelShape.from_config(config)
    e = EngineSide(tp=tp, dtype="bfloat16", max_model_len=4096, block_size=16, max_num_seqs=256,
                   kv_cap_bytes=None, memory_fraction=0.9, seq_tokens=4096)
    assert kv_bytes_per_token_per_rank(shape, e) == per_token
    if tp == 1:
        assert shape.kv_bytes_per_token(2) == per_token


def test_engine_weights_divide_by_tp_and_the_kv_budget_sets_the_sequences():
    shape = ModelShape.from_config(LLAMA2_7B)
    e = EngineSide(tp=2, dtype="bfloat16", max_model_len=4096, block_size=16, max_num_seqs=256,
                   kv_cap_bytes=None, memory_fraction=0.5, seq_tokens=4096)
    m = engine_memory(shape, e, 80e9)
    assert m["weights"] == shape.params() * 2 / 2
    assert m["kv_cache"] == pytest.approx(40e9 - m["weights"])
    per_seq = 4096 // 16 * 16 * (2 * 32 * 16 * 128 * 2)  # a rank's 16 heads, 256 blocks
    assert m["max_sequences"] == int(m["kv_cache"] // per_seq)
    assert m["kv_per_sequence"] == 4096 * 2 * 32 * 16 * 128 * 2  # 256 MiB on each rank


def test_cpu_kv_cache_is_what_max_num_seqs_take_at_most_the_cap():
    """rollout.vllm_cpu.kv_cache_bytes: the quickstart's model needs 0.125 GiB."""
    shape = ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384,
                       vocab=512, tied=False)
    e = EngineSide(tp=1, dtype="float32", max_model_len=512, block_size=32, max_num_seqs=256,
                   kv_cap_bytes=2 ** 30, memory_fraction=0.5, seq_tokens=40)
    assert engine_memory(shape, e, 24 * 2 ** 30)["kv_cache"] == 256 * 512 * 2 * 2 * 2 * 32 * 4


def test_zero_1_2_buffers_a_float32_partition_copy_and_the_reduce_bucket():
    from rl.plan.memory import zero_buffers

    s = side(2, 2, "float32")
    assert zero_buffers(1e8, s) == 1e8 * 4 / 2 + 1e8 * 4  # copy of the half, whole gradient
    assert zero_buffers(1e10, s) == 1e10 * 4 / 2 + 5e8 * 4  # the bucket caps at 5e8 elements
    assert zero_buffers(1e8, side(2, 2)) == 1e8 * 2  # bf16: the master copy is a model state
    assert zero_buffers(1e8, side(0, 2, "float32")) == zero_buffers(1e8, side(0, 2)) == 0


def test_zero_3_keeps_a_float32_master_copy_and_a_bucket_of_its_release_unit():
    """DeepSpeed's ZeRO-3 copies float32 weights into a master partition (its reuse test compares
    a torch.device with a string); bench-100m at rest held that 193 MiB copy and a 24 MiB bucket
    of one decoder layer (docs/planning.md)."""
    from dataclasses import replace

    from rl.plan.memory import REDUCE_BUCKET, reduce_bucket, zero_buffers

    s = side(3, 2, "float32")
    assert zero_buffers(1e8, s, 6e6) == 1e8 * 4 / 2 + 6e6 * 4
    assert zero_buffers(1e8, side(3, 2), 6e6) == 6e6 * 2  # bf16: the master copy is a state
    assert zero_buffers(1e6, s) == 1e6 * 4 / 2 + 1e6 * 4  # CPU: the bucket's touched pages
    assert zero_buffers(1e6, replace(s, gpu=True)) == 1e6 * 4 / 2 + REDUCE_BUCKET * 4
    bench = ModelShape(hidden=768, layers=16, heads=12, kv_heads=4, head_dim=64,
                       intermediate=2048, vocab=384, tied=False, qkv_bias=True)
    assert bench.layer_params() == 6_294_272  # the real model's decoder layer (24 MiB in fp32)
    assert reduce_bucket(bench, s) == bench.layer_params()
    big_vocab = replace(bench, vocab=49152)
    assert reduce_bucket(big_vocab, s) == big_vocab.embedding_params()  # the largest unit
    assert reduce_bucket(bench, replace(s, whole_model_max=10 ** 9)) == REDUCE_BUCKET  # whole
    assert reduce_bucket(bench, replace(s, release=False)) == REDUCE_BUCKET
    assert reduce_bucket(bench, side(2, 2, "float32")) == REDUCE_BUCKET


def test_a_cpu_engine_that_repacks_holds_its_linears_twice():
    """rollout.cpu_linear=repack keeps each linear's weight beside oneDNN's packed copy (measured
    on Qwen2.5-3B's shape in bf16: the engine's process grew by 12.6 GiB with a 1 GiB KV cache
    where the weights are 5.75 GiB); auto packs once where a TP-1 engine serves a LoRA adapter."""
    from rl.config import load_config
    from rl.plan.plan import engine_side

    shape = ModelShape.from_config(dict(
        model_type="qwen2", hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
        tie_word_embeddings=True))
    assert shape.params() == 3_085_938_688  # Qwen2.5-3B
    lora = ["trainer.lora={rank: 8}"]
    for overrides, twice in (([], True), (lora, True), ([*lora, "sync.lora=adapters"], False),
                             ([*lora, "sync.lora=adapters", "rollout.cpu_linear=repack"], True),
                             (["rollout.cpu_linear=plain"], False)):
        cfg = load_config("recipes/quickstart.yaml", overrides)
        e = engine_side(cfg, gpu=False, prompt_tokens=31)
        assert engine_memory(shape, e, 24 * 2 ** 30)["weights"] == 4 * (
            shape.params() + twice * shape.linear_params()), overrides
        assert not engine_side(cfg, gpu=True, prompt_tokens=31).kept_weights  # GPU: no copy


@pytest.mark.parametrize("share", [True, False])
def test_activations_are_what_autograd_keeps_of_a_padded_micro_batch(share):
    """The plan's activations against the bytes update.forward's pass saves for its backward
    (saved-tensor hooks), on a GQA model with padded prompts and responses, as RL batches are:
    transformers repeats the KV heads before SDPA under a padding mask, so each sequence keeps
    its keys and values at the query heads' width (with shared prompts, every sample its
    prompt's again). Within 15%: the plan counts padded lengths and R response positions where
    the shared pass runs R - 1, and leaves out masks, rotary tables and the head's input."""
    import random

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl.algo.batch import Sample, collate
    from rl.plan.memory import activation_bytes
    from update.forward import response_parts
    from update.mlp import lean_gated_mlps

    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa"))
    lean_gated_mlps(model)  # as update.trainer runs it
    rng, samples = random.Random(0), []
    for g in range(4):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(10, 14))]
        for _ in range(4):
            r = [rng.randrange(3, 60) for _ in range(rng.randint(3, 6))]
            samples.append(Sample(g, g, prompt, r, [-1.0] * len(r), "stop", "",
                                  advantages=[1.0] * len(r)))
    mb = collate(samples, 0, share_prompts=share)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        response_parts(model, mb)
    s = TrainerSide(ranks=1, zero_stage=0, dtype="float32", bf16_mode="weights", micro_batch=16,
                    prompt_tokens=max(len(x.prompt_ids) for x in samples),
                    response_tokens=mb["response_mask"].shape[1], group_size=4,
                    share_prompts=share, checkpointing=False, whole_model_max=0, release=True,
                    reference=False, critic=False)
    planned = activation_bytes(ModelShape.from_config(dict(cfg, model_type="qwen2")), s)
    assert 0.85 <= planned / sum(kept.values()) <= 1.15, (planned, sum(kept.values()))
