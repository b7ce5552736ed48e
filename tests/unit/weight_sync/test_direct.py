"""Direct placement against vLLM's own loaders: real vLLM layers (a Qwen2 decoder layer's worth,
TP rank patched) load the full HF tensors the normal way; `DirectLoad` fed what the sender sends
that rank (full tensors at tp 1, `shard_for_rank` slices above) must leave identical parameters."""
import pytest
import torch

from weight_sync.direct import DirectLoad, DirectLoadError
from weight_sync.resharding import TPSpec, shard_for_rank, shard_range

HIDDEN, HEAD_DIM, INTERMEDIATE, VOCAB = 16, 4, 32, 100
ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"


def _distinct(*shape):
    """Every element different, so a tensor placed at the wrong rows cannot pass."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1


def _hf(heads, kv_heads):
    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    rows = {"q": q, "k": kv, "v": kv}
    return {"model.embed_tokens.weight": _distinct(VOCAB, HIDDEN),
            **{f"{ATTN}.{p}_proj.weight": _distinct(n, HIDDEN) for p, n in rows.items()},
            **{f"{ATTN}.{p}_proj.bias": _distinct(n) for p, n in rows.items()},
            f"{ATTN}.o_proj.weight": _distinct(HIDDEN, q),
            f"{MLP}.gate_proj.weight": _distinct(INTERMEDIATE, HIDDEN),
            f"{MLP}.up_proj.weight": _distinct(INTERMEDIATE, HIDDEN),
            f"{MLP}.down_proj.weight": _distinct(HIDDEN, INTERMEDIATE),
            "model.norm.weight": _distinct(HIDDEN),
            "lm_head.weight": _distinct(VOCAB, HIDDEN)}


def _vllm_reference(vllm_tp, hf, heads, kv_heads, rank, tp_size):
    """vLLM's layers on this rank, loaded from the full tensors as Qwen2's load_weights does."""
    vllm_tp.at(rank, tp_size)
    lin, voc = vllm_tp.linear, vllm_tp.vocab
    layers = {"model.embed_tokens": voc.VocabParallelEmbedding(VOCAB, HIDDEN),
              f"{ATTN}.qkv_proj": lin.QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads),
              f"{ATTN}.o_proj": lin.RowParallelLinear(heads * HEAD_DIM, HIDDEN, bias=False),
              f"{MLP}.gate_up_proj": lin.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2,
                                                                    bias=False),
              f"{MLP}.down_proj": lin.RowParallelLinear(INTERMEDIATE, HIDDEN, bias=False),
              "lm_head": voc.ParallelLMHead(VOCAB, HIDDEN)}
    params = {f"{m}.{n}": p for m, layer in layers.items() for n, p in layer.named_parameters()}
    params["model.norm.weight"] = torch.nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)
    fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for name, tensor in hf.items():
        module, leaf = name.rsplit(".", 2)[-2:]
        if module in fused:
            target, shard_id = fused[module]
            param = params[name.replace(f".{module}.", f".{target}.")]
            param.weight_loader(param, tensor, shard_id)
        elif name == "model.norm.weight":
            params[name].data.copy_(tensor)
        else:
            params[name].weight_loader(params[name], tensor)
    return {n: p.data for n, p in params.items()}


@pytest.mark.parametrize("heads,kv_heads,tp_size", [(4, 4, 1), (8, 2, 1), (4, 4, 2), (8, 2, 4)])
def test_direct_load_leaves_what_vllms_loaders_leave(vllm_tp, heads, kv_heads, tp_size):
    hf = _hf(heads, kv_heads)
    spec = TPSpec(tp_size, heads, kv_heads, HEAD_DIM, INTERMEDIATE, VOCAB)
    for rank in range(tp_size):
        reference = _vllm_reference(vllm_tp, hf, heads, kv_heads, rank, tp_size)
        ours = {n: torch.full_like(t, float("nan")) for n, t in reference.items()}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # padding rows: as started
            real = shard_range(name, (VOCAB, HIDDEN), spec, rank).length
            ours[name][real:] = reference[name][real:]
        sent = ((n, t if tp_size == 1 else shard_for_rank(n, t, spec, rank)) for n, t in hf.items())
        DirectLoad(ours, spec, rank)(sent)
        for name, want in reference.items():
            assert torch.equal(ours[name], want), f"{name} differs on rank {rank}/{tp_size}"


def _tiny():
    spec = TPSpec(1, 4, 4, HEAD_DIM, INTERMEDIATE, VOCAB)
    hf = _hf(4, 4)
    params = {f"{ATTN}.qkv_proj.weight": torch.zeros(3 * 16, HIDDEN),
              "model.norm.weight": torch.zeros(HIDDEN)}
    embed = torch.zeros(128, HIDDEN)  # vocab 100 padded to 128
    # tied: one storage under two tensor objects, as the engine's `p.data` hands them out
    params.update({"model.embed_tokens.weight": embed, "lm_head.weight": embed.view_as(embed)})
    return spec, hf, params


def test_a_missing_tensor_is_named_with_the_rows_it_left():
    spec, hf, params = _tiny()
    sent = [(n, hf[n]) for n in (f"{ATTN}.q_proj.weight", f"{ATTN}.v_proj.weight",
                                 "model.norm.weight", "model.embed_tokens.weight")]
    with pytest.raises(DirectLoadError, match=r"1 engine parameter.*qkv_proj.weight \(32/48 rows\)"):
        DirectLoad(params, spec)(sent)


def test_a_tied_head_is_filled_by_either_name_and_padding_is_not_required():
    spec, hf, params = _tiny()
    for head in ("model.embed_tokens.weight", "lm_head.weight"):
        sent = [(n, hf[n]) for n in (f"{ATTN}.q_proj.weight", f"{ATTN}.k_proj.weight",
                                     f"{ATTN}.v_proj.weight", "model.norm.weight", head)]
        DirectLoad(params, spec)(sent)
        assert torch.equal(params["model.embed_tokens.weight"][:VOCAB], hf[head])


def test_a_tensor_without_a_place_or_of_another_shape_is_an_error():
    spec, hf, params = _tiny()
    with pytest.raises(DirectLoadError, match=r"'model.layers.0.mlp.up_proj.weight' goes to "
                                              r"engine parameter .*gate_up_proj.weight"):
        DirectLoad(params, spec)([(f"{MLP}.up_proj.weight", hf[f"{MLP}.up_proj.weight"])])
    with pytest.raises(DirectLoadError, match=r"\(16, 8\) does not fit rows \[16, 32\)"):
        DirectLoad(params, spec)([(f"{ATTN}.k_proj.weight", torch.zeros(16, 8))])


def test_only_known_architectures_are_placed_directly():
    assert DirectLoad.supports("qwen2") and DirectLoad.supports("llama")
    assert not DirectLoad.supports("mixtral")
