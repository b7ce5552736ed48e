"""TP slicing against vLLM's own loaders: real vLLM layers, built with the TP rank/size patched,
load the FULL tensor the normal way; what lands on each rank must equal our slice at our slot."""
import pytest
import torch

from weight_sync.resharding import (VOCAB_PADDING, SliceBytes, TPSpec, local_param_slot,
                                    shard_for_rank, shard_range, slice_bytes)

HIDDEN, HEAD_DIM, INTERMEDIATE = 16, 4, 32
ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"


def _spec(tp_size, num_heads=4, num_kv_heads=4, vocab_size=100):
    return TPSpec(tp_size, num_heads, num_kv_heads, HEAD_DIM, INTERMEDIATE, vocab_size)


def _distinct(*shape):
    """Every element different, so a slice taken from the wrong place cannot pass."""
    n = torch.Size(shape).numel()
    return torch.arange(n, dtype=torch.float32).reshape(shape) + 1


def _model(spec):
    q_rows, kv_rows = spec.num_heads * HEAD_DIM, spec.num_kv_heads * HEAD_DIM
    return {
        "model.embed_tokens.weight": _distinct(spec.vocab_size, HIDDEN),
        **{f"{ATTN}.{p}_proj.weight": _distinct(rows, HIDDEN)
           for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))},
        **{f"{ATTN}.{p}_proj.bias": _distinct(rows)
           for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))},
        f"{ATTN}.o_proj.weight": _distinct(HIDDEN, q_rows),
        f"{MLP}.gate_proj.weight": _distinct(INTERMEDIATE, HIDDEN),
        f"{MLP}.up_proj.weight": _distinct(INTERMEDIATE, HIDDEN),
        f"{MLP}.down_proj.weight": _distinct(HIDDEN, INTERMEDIATE),
        "model.layers.0.input_layernorm.weight": _distinct(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": _distinct(HIDDEN),
        "model.norm.weight": _distinct(HIDDEN),
        "lm_head.weight": _distinct(spec.vocab_size, HIDDEN),
    }


def _load_full(layer, full, shard_ids):
    """Load full HF tensors into a vLLM layer as Qwen2ForCausalLM.load_weights does."""
    for name, tensor in full.items():
        param = getattr(layer, name.rsplit(".", 1)[1])
        param.weight_loader(param, tensor, *shard_ids(name))


def _assemble(full, spec, rank, local):
    """Place our slices at our slots in NaN-filled copies of the rank's local params."""
    out = {target: torch.full_like(p, float("nan")) for target, p in local.items()}
    for name, tensor in full.items():
        target, offset = local_param_slot(name, spec)
        piece = shard_for_rank(name, tensor, spec, rank)
        out[target].narrow(0, offset, piece.shape[0]).copy_(piece)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads,tp_size",
                         [(4, 4, 2), (8, 2, 2), (8, 2, 4), (4, 1, 4), (8, 4, 2)])
def test_qkv_slices_at_their_slots_rebuild_vllms_fused_qkv(vllm_tp, num_heads, num_kv_heads,
                                                           tp_size):
    spec = _spec(tp_size, num_heads, num_kv_heads)
    full = {n: t for n, t in _model(spec).items() if "_proj" in n and n.split(".")[-2][0] in "qkv"}
    for rank in range(tp_size):
        vllm_tp.at(rank, tp_size)
        layer = vllm_tp.linear.QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads)
        _load_full(layer, full, lambda n: (n.split(".")[-2][0],))  # weight: loader_v2, bias: v1
        local = {f"{ATTN}.qkv_proj.weight": layer.weight.data,
                 f"{ATTN}.qkv_proj.bias": layer.bias.data}
        for target, ours in _assemble(full, spec, rank, local).items():
            assert torch.equal(ours, local[target]), f"{target} differs on rank {rank}/{tp_size}"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_gate_up_slices_at_their_slots_rebuild_vllms_fused_gate_up(vllm_tp, tp_size):
    spec = _spec(tp_size)
    full = {n: t for n, t in _model(spec).items() if "gate_proj" in n or "up_proj" in n}
    for rank in range(tp_size):
        vllm_tp.at(rank, tp_size)
        layer = vllm_tp.linear.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False)
        _load_full(layer, full, lambda n: (0 if "gate" in n else 1,))
        local = {f"{MLP}.gate_up_proj.weight": layer.weight.data}
        ours = _assemble(full, spec, rank, local)[f"{MLP}.gate_up_proj.weight"]
        assert torch.equal(ours, layer.weight.data), f"rank {rank}/{tp_size}"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_weight_split_by_columns_and_bias_whole_as_vllm(vllm_tp, tp_size):
    spec = _spec(tp_size)
    full = {f"{MLP}.down_proj.weight": _distinct(HIDDEN, INTERMEDIATE),
            f"{MLP}.down_proj.bias": _distinct(HIDDEN)}
    for rank in range(tp_size):
        vllm_tp.at(rank, tp_size)
        layer = vllm_tp.linear.RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True)
        _load_full(layer, full, lambda n: ())
        for name, tensor in full.items():
            assert local_param_slot(name, spec) == (name, 0)
            loaded = getattr(layer, name.rsplit(".", 1)[1]).data
            assert torch.equal(shard_for_rank(name, tensor, spec, rank), loaded), name


# vocab 100, tp 4: padded to 128, 32 rows a rank: [0, 32) [32, 64) [64, 96) [96, 100) + 28 zeros
# vocab 70,  tp 4: padded to 128: [0, 32) [32, 64) [64, 70) + 26 zeros, and rank 3 gets no rows
# vocab 130, tp 2: padded to 192, 96 rows a rank: [0, 96) [96, 130) + 62 zeros
@pytest.mark.parametrize("vocab_size,tp_size", [(100, 4), (70, 4), (130, 2), (192, 2)])
@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_vocab_slice_is_what_vllms_loader_writes_before_its_zero_padding(vllm_tp, name,
                                                                         vocab_size, tp_size):
    spec = _spec(tp_size, vocab_size=vocab_size)
    full = _distinct(vocab_size, HIDDEN)
    vocab = vllm_tp.vocab
    assert vocab.DEFAULT_VOCAB_PADDING_SIZE == VOCAB_PADDING
    cls = vocab.ParallelLMHead if name == "lm_head.weight" else vocab.VocabParallelEmbedding
    for rank in range(tp_size):
        vllm_tp.at(rank, tp_size)
        layer = cls(vocab_size, HIDDEN)
        layer.weight.weight_loader(layer.weight, full)
        ours = shard_for_rank(name, full, spec, rank)
        shard = shard_range(name, full.shape, spec, rank)
        assert layer.weight.shape[0] == shard.local_length
        assert torch.equal(layer.weight.data[: shard.length], ours)
        assert not layer.weight.data[shard.length:].any(), "vLLM zero-fills the padding rows"


def test_vocab_ranges_by_hand():
    spec = _spec(4, vocab_size=70)
    shards = [shard_range("lm_head.weight", (70, HIDDEN), spec, r) for r in range(4)]
    assert [(s.start, s.length, s.local_length) for s in shards] == [
        (0, 32, 32), (32, 32, 32), (64, 6, 32), (70, 0, 32)]


@pytest.mark.parametrize("tp_size,num_kv_heads", [(2, 4), (2, 2), (4, 2), (4, 1)])
def test_slices_over_ranks_rebuild_every_full_tensor(tp_size, num_kv_heads):
    spec = _spec(tp_size, num_heads=4, num_kv_heads=num_kv_heads)
    for name, full in _model(spec).items():
        slices = [shard_for_rank(name, full, spec, r) for r in range(tp_size)]
        dim = shard_range(name, full.shape, spec, 0).dim
        if "norm" in name:
            assert all(torch.equal(s, full) for s in slices), name
            continue
        replicas = spec.kv_replicas if name.split(".")[-2] in ("k_proj", "v_proj") else 1
        for r in range(tp_size):  # ranks sharing a KV head receive the same slice
            assert torch.equal(slices[r], slices[r - r % replicas]), name
        assert torch.equal(torch.cat(slices[::replicas], dim), full), name


def test_gqa_kv_heads_and_slots_by_hand():
    # 8 query heads, 2 KV heads of 4 rows each. tp 2: one KV head a rank.
    k = f"{ATTN}.k_proj.weight"
    tp2 = _spec(2, num_heads=8, num_kv_heads=2)
    assert [shard_range(k, (8, HIDDEN), tp2, r).start for r in range(2)] == [0, 4]
    # tp 4: vLLM replicates, head r // 2: ranks 0, 1 hold rows [0, 4); ranks 2, 3 rows [4, 8)
    tp4 = _spec(4, num_heads=8, num_kv_heads=2)
    assert [shard_range(k, (8, HIDDEN), tp4, r).start for r in range(4)] == [0, 0, 4, 4]
    # local qkv on tp 4: q is 2 heads (8 rows), then k 1 head (4), then v (4)
    slots = [local_param_slot(f"{ATTN}.{p}_proj.bias", tp4) for p in "qkv"]
    assert slots == [(f"{ATTN}.qkv_proj.bias", 0), (f"{ATTN}.qkv_proj.bias", 8),
                     (f"{ATTN}.qkv_proj.bias", 12)]
    assert local_param_slot(f"{MLP}.up_proj.weight", tp4) == (f"{MLP}.gate_up_proj.weight", 8)


def test_slice_bytes_by_hand():
    # hidden 8, 4 heads of 2, 2 KV heads, vocab 100 (padded 128: 64 rows a rank), tp 2, float32
    spec = TPSpec(2, num_heads=4, num_kv_heads=2, head_dim=2, intermediate_size=16, vocab_size=100)
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    named = [("model.embed_tokens.weight", meta(100, 8)),  # 800 = 512 + 288 elements
             (f"{ATTN}.q_proj.weight", meta(8, 8)),  # 64 = 32 + 32
             (f"{ATTN}.k_proj.weight", meta(4, 8)),  # 32 = 16 + 16
             (f"{ATTN}.o_proj.weight", meta(8, 8)),  # 64 = 32 + 32
             ("model.norm.weight", meta(8))]  # 8, whole on each rank
    assert slice_bytes(named, spec) == SliceBytes(full=968 * 4, per_rank=(600 * 4, 376 * 4))


@pytest.mark.parametrize("tp_size,num_kv_heads", [(2, 4), (4, 2), (4, 1)])
def test_slice_bytes_match_the_slices(tp_size, num_kv_heads):
    spec = _spec(tp_size, num_kv_heads=num_kv_heads)
    model = {n: t.to(torch.bfloat16) for n, t in _model(spec).items()}
    counted = slice_bytes(((n, t.to("meta")) for n, t in model.items()), spec)
    assert counted.full == sum(t.numel() * 2 for t in model.values())
    assert counted.per_rank == tuple(sum(shard_for_rank(n, t, spec, r).numel() * 2
                                         for n, t in model.items()) for r in range(tp_size))
    assert max(counted.per_rank) < counted.full


def test_from_hf_config_reads_qwen2_and_llama():
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=1000)
    assert TPSpec.from_hf_config(qwen, 4) == TPSpec(4, 8, 2, 8, 128, 1000)
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                                     head_dim=32, intermediate_size=128, vocab_size=1000)
    assert TPSpec.from_hf_config(llama, 2).head_dim == 32  # given head_dim wins, as in vLLM


def test_unknown_name_says_which_tensor_and_where_to_add_a_rule():
    spec = _spec(2)
    name = "model.layers.0.mlp.experts.3.w1.weight"
    for call in (lambda: shard_for_rank(name, torch.zeros(4, 4), spec, 0),
                 lambda: local_param_slot(name, spec)):
        with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight.*_RULES in weight_sync"):
            call()


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=14), "num_heads=14 is not divisible by tp_size=4"),
    (dict(num_heads=12, num_kv_heads=3), "not a multiple of num_kv_heads=3"),
    (dict(num_kv_heads=6, num_heads=8), "num_kv_heads=6 is not divisible"),
])
def test_spec_refuses_what_vllm_cannot_split(kwargs, message):
    base = dict(tp_size=4, num_heads=8, num_kv_heads=8, head_dim=4, intermediate_size=32,
                vocab_size=100)
    with pytest.raises(ValueError, match=message):
        TPSpec(**{**base, **kwargs})


def test_wrong_shape_or_rank_is_an_error():
    spec = _spec(2)
    with pytest.raises(ValueError, match="has 12 rows, the TPSpec implies 16"):
        shard_for_rank(f"{ATTN}.q_proj.weight", torch.zeros(12, HIDDEN), spec, 0)
    with pytest.raises(ValueError, match="tp_rank=2 is outside 0..1"):
        shard_for_rank("model.norm.weight", torch.zeros(HIDDEN), spec, 2)
