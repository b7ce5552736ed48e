"""In-place buckets: cut from the engine's packed layout, they must rebuild, byte for byte, the
buffer an engine holds after `DirectLoad` of the same HF tensors (fused q/k/v and gate/up, the
padded vocab with zero padding rows, a tied head stored once), and tile it without a gap."""
import pytest
import torch

from weight_sync.direct import DirectLoad, DirectLoadError
from weight_sync.in_place import EngineLayout, plan_in_place
from weight_sync.layout import TRAILER
from weight_sync.resharding import TPSpec

H, V, I = 16, 100, 24  # hidden, vocab (padded to 128 in the engine), intermediate
ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"
SPEC = TPSpec(1, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=I, vocab_size=V)


def hf_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (V, H), f"{ATTN}.q_proj.weight": (16, H),
              f"{ATTN}.k_proj.weight": (8, H), f"{ATTN}.v_proj.weight": (8, H),
              f"{ATTN}.q_proj.bias": (16,), f"{ATTN}.k_proj.bias": (8,), f"{ATTN}.v_proj.bias": (8,),
              f"{MLP}.gate_proj.weight": (I, H), f"{MLP}.up_proj.weight": (I, H),
              f"{MLP}.down_proj.weight": (H, I), "model.norm.weight": (H,)}
    return {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}


def engine_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    embed = torch.zeros(128, H, dtype=dtype)
    return {"model.embed_tokens.weight": embed, f"{ATTN}.qkv_proj.weight": torch.zeros(32, H, dtype=dtype),
            f"{ATTN}.qkv_proj.bias": torch.zeros(32, dtype=dtype),
            f"{MLP}.gate_up_proj.weight": torch.zeros(2 * I, H, dtype=dtype),
            f"{MLP}.down_proj.weight": torch.zeros(H, I, dtype=dtype),
            "model.norm.weight": torch.zeros(H, dtype=dtype), "lm_head.weight": embed}


def send_in_place(layout: EngineLayout, hf: dict, bucket_bytes: int, aliases=None):
    """What the engine's buffer holds after every bucket landed (the sender's side, by hand)."""
    buckets = plan_in_place([layout], [(n, list(t.shape)) for n, t in hf.items()], aliases or {},
                            SPEC, bucket_bytes)
    flat = torch.full((layout.nbytes + TRAILER,), 0xAB, dtype=torch.uint8)  # garbage first
    for b in buckets:
        data = torch.zeros(b.nbytes, dtype=torch.uint8)  # the gaps are zeros
        for m in b.tensors:
            data[m.offset:m.offset + m.nbytes].view(getattr(torch, m.dtype)).copy_(
                hf[m.name].reshape(-1))
        flat[b.start:b.start + b.nbytes] = data
    return buckets, flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [1, 900, 4096, 2**20])
def test_in_place_buckets_rebuild_what_direct_load_leaves(dtype, bucket_bytes):
    hf, params = hf_tensors(), engine_params(dtype)
    layout = EngineLayout.of(params)
    assert layout.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    reference, views = layout.pack(params)
    DirectLoad(views, SPEC)(hf.items())
    buckets, flat = send_in_place(layout, hf, bucket_bytes)
    assert torch.equal(flat[:layout.nbytes], reference[:layout.nbytes])
    starts = [b.start for b in buckets]
    assert starts[0] == 0 and all(a.start + a.nbytes == b.start for a, b in zip(buckets, buckets[1:]))
    assert buckets[-1].start + buckets[-1].nbytes == layout.nbytes  # tiled, no gap
    assert all(b.start % 8 == 0 and b.nbytes % 8 == 0 for b in buckets)  # 64-bit checksums
    if bucket_bytes == 2**20:
        assert len(buckets) == 1


def test_a_separate_engine_head_gets_the_tied_trainer_embedding_twice():
    hf, params = hf_tensors(), engine_params()
    params["lm_head.weight"] = torch.zeros(128, H)  # this engine does not tie
    layout = EngineLayout.of(params)
    _, flat = send_in_place(layout, hf, 4096, {"lm_head.weight": "model.embed_tokens.weight"})
    head = next(m for m in layout.tensors if m.name == "lm_head.weight")
    got = flat[head.offset:head.offset + head.nbytes].view(torch.float32).view(128, H)
    assert torch.equal(got[:V], hf["model.embed_tokens.weight"])


def test_a_missing_tensor_or_a_wrong_shape_is_an_error():
    hf, layout = hf_tensors(), EngineLayout.of(engine_params())
    del hf[f"{MLP}.up_proj.weight"]
    with pytest.raises(DirectLoadError, match=r"cover 1536 of the 3072 bytes of engine parameter "
                                              r"'model.layers.0.mlp.gate_up_proj.weight'"):
        plan_in_place([layout], [(n, list(t.shape)) for n, t in hf.items()], {}, SPEC, 4096)
    with pytest.raises(DirectLoadError, match=r"\[9, 16\] does not fit engine parameter"):
        plan_in_place([layout], [(f"{ATTN}.v_proj.weight", [9, H])], {}, SPEC, 4096)


def test_layout_round_trips_and_its_digest_tells_layouts_apart():
    layout = EngineLayout.of(engine_params())
    assert EngineLayout.decode(layout.encode()) == layout
    assert EngineLayout.of(engine_params(torch.bfloat16)).digest() != layout.digest()


class _InstantGroup:
    """Stands in for a CollectiveGroup on the receiving side: each broadcast is complete the moment
    it is posted (the worst case for a trailer that the next bucket overwrites)."""

    device = "cpu"

    def __init__(self, layout_bytes: bytes, payloads: list[torch.Tensor]):
        self.layout_bytes, self.payloads = layout_bytes, list(payloads)

    def broadcast_bytes(self, data):
        return self.layout_bytes

    def broadcast(self, buffer):
        buffer.copy_(self.payloads.pop(0))
        return type("Done", (), {"wait": lambda self: None})()


def _wire(buckets, flat_sent, corrupt=None):
    """Each bucket as the sender puts it on the wire: its bytes, then its sum64 trailer."""
    from weight_sync.checksums import sum64
    from weight_sync.layout import write_trailer

    out = []
    for k, b in enumerate(buckets):
        buf = torch.zeros(b.nbytes + TRAILER, dtype=torch.uint8)
        buf[:b.nbytes] = flat_sent[b.start:b.start + b.nbytes]
        write_trailer(buf, b, sum64(buf[:b.nbytes]))
        if k == corrupt:
            buf[0] ^= 0x5A
        out.append(buf)
    return out


@pytest.mark.parametrize("corrupt", [None, 1])
def test_the_receiver_lands_buckets_in_place_and_checks_each_before_the_next_overwrites(corrupt):
    from weight_sync.layout import SyncLayout
    from weight_sync.transport import BroadcastTransport, WeightSyncError

    hf, params = hf_tensors(), engine_params()
    layout = EngineLayout.of(params)
    buckets, sent = send_in_place(layout, hf, 900)
    assert len(buckets) > 2
    message = SyncLayout(3, "sum64", buckets, {}, layout.digest()).encode()
    flat, _ = layout.pack(params)  # the engine's packed (old) weights
    group = _InstantGroup(message, _wire(buckets, sent, corrupt))
    transport = BroadcastTransport(group, 0)
    loads = []
    if corrupt is None:
        transport.receive(loads.append, 3, keeps_views=False, packed=(layout.digest(), flat))
        assert torch.equal(flat[:layout.nbytes], sent[:layout.nbytes]) and not loads
    else:
        with pytest.raises(WeightSyncError, match=r"bucket 1/\d+ .* failed its sum64 check"):
            transport.receive(loads.append, 3, keeps_views=False, packed=(layout.digest(), flat))
    with pytest.raises(WeightSyncError, match="cut buckets for engine layout .* not packed"):
        BroadcastTransport(_InstantGroup(message, _wire(buckets, sent)), 0).receive(
            loads.append, 3, keeps_views=False, packed=None)
