"""Trainer shards written straight into TP ranks' slices (weight_sync.tp_shared.write_shards),
against vLLM's own loaders: whatever the trainer world (ZeRO parts that cut rows anywhere), every
TP rank must end up with what vLLM's layers load from the full tensors on that rank."""
import mmap
from collections import Counter

import pytest
import torch

from tests.unit.weight_sync.test_direct import HIDDEN, VOCAB, _hf, _vllm_reference
from weight_sync.in_place import EngineLayout
from weight_sync.resharding import Shard, TPSpec, copy_into_slice, row_blocks, shard_range
from weight_sync.direct import DirectLoadError
from weight_sync.tp_shared import TPSharedWeights, check_filled

HEAD_DIM, INTERMEDIATE = 4, 32


def test_row_blocks_cover_a_flat_range_once_in_order():
    for start, stop, cols in [(0, 12, 4), (1, 11, 4), (3, 5, 4), (5, 6, 4), (4, 8, 4), (2, 3, 1)]:
        covered = []
        for r0, r1, c0, c1, at in row_blocks(start, stop, cols):
            assert at == len(covered)
            covered += [r * cols + c for r in range(r0, r1) for c in range(c0, c1)]
        assert covered == list(range(start, stop)), (start, stop, cols)


def test_a_column_slice_takes_only_its_columns_from_a_part_that_cuts_rows():
    full = torch.arange(24.0).view(4, 6)
    dst = torch.zeros(4, 3)
    shard = Shard(1, 3, 3, 3)  # columns 3..5
    for start, stop in [(0, 8), (8, 17), (17, 24)]:
        copy_into_slice(full.view(-1)[start:stop], start, 6, shard, dst, 0)
    assert torch.equal(dst, full[:, 3:])


def _shared(references: list[dict], spec: TPSpec) -> TPSharedWeights:
    """Every TP rank's parameters in anonymous memory, laid out as an engine's: NaN but for the
    vocab's padding rows, which a sync never writes."""
    layouts = {r: EngineLayout.of(ref) for r, ref in enumerate(references)}
    shared = TPSharedWeights(spec, layouts, {r: mmap.mmap(-1, max(layout.nbytes, 64))
                                             for r, layout in layouts.items()})
    for r, ref in enumerate(references):
        for name, view in shared.views[r].items():
            view.fill_(float("nan"))
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                real = shard_range(name, (VOCAB, HIDDEN), spec, r).length
                view[real:] = ref[name][real:]
    return shared


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("heads,kv_heads,tp_size", [(4, 4, 2), (8, 2, 4)])
def test_trainer_parts_land_where_vllms_loaders_put_them(vllm_tp, heads, kv_heads, tp_size,
                                                          world, tied):
    hf = _hf(heads, kv_heads)
    aliases = {}
    if tied:  # the trainer sends the embedding once; each engine rank's head shares its storage
        del hf["lm_head.weight"]
        aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    spec = TPSpec(tp_size, heads, kv_heads, HEAD_DIM, INTERMEDIATE, VOCAB)
    references = []
    for r in range(tp_size):
        ref = _vllm_reference(vllm_tp, {**hf, **{a: hf[s] for a, s in aliases.items()}}, heads,
                              kv_heads, r, tp_size)
        if tied:
            ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
        references.append(ref)
    shared = _shared(references, spec)
    params = [(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in hf.items()]
    written = Counter()
    for rank in range(world):  # whole parameters: each rank writes an equal element range
        written.update(shared.write_shards(params, aliases, rank, world))
    assert dict(written) == shared.expected()
    for r, ref in enumerate(references):
        for name, want in ref.items():
            assert torch.equal(shared.views[r][name], want), f"{name}, TP rank {r}/{tp_size}"


def test_a_trainer_rank_that_skipped_its_part_leaves_slices_unfilled(vllm_tp):
    hf = _hf(4, 4)
    spec = TPSpec(2, 4, 4, HEAD_DIM, INTERMEDIATE, VOCAB)
    shared = _shared([_vllm_reference(vllm_tp, hf, 4, 4, r, 2) for r in range(2)], spec)
    params = [(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in hf.items()]
    written = Counter(shared.write_shards(params, {}, 0, 2))  # rank 1 of 2 wrote nothing
    expected = shared.expected()
    with pytest.raises(DirectLoadError, match=r"TP rank 0 got \d+ of \d+ elements"):
        check_filled([written[t] for t in range(2)], [expected[t] for t in range(2)])
    written.update(shared.write_shards(params, {}, 1, 2))
    check_filled([written[t] for t in range(2)], [expected[t] for t in range(2)])


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("bucket_bytes", [1, 700, 2**20])
@pytest.mark.parametrize("heads,kv_heads,tp_size", [(4, 4, 2), (8, 2, 4)])
def test_in_place_buckets_of_tp_ranks_rebuild_each_rank(vllm_tp, heads, kv_heads, tp_size,
                                                         bucket_bytes, world):
    """Disaggregated, in place: buckets tile each TP rank's buffer, in rounds; the trainer ranks
    write their parts of each bucket's slices (node_buckets.write_shards, gaps zeroed as
    NodeBuckets does) and each bucket lands at its place in its rank's buffer."""
    from weight_sync.in_place import plan_in_place
    from weight_sync.layout import TRAILER
    from weight_sync.node_buckets import write_shards
    from weight_sync.transport import rounds

    hf = _hf(heads, kv_heads)
    spec = TPSpec(tp_size, heads, kv_heads, HEAD_DIM, INTERMEDIATE, VOCAB)
    references = [_vllm_reference(vllm_tp, hf, heads, kv_heads, r, tp_size)
                  for r in range(tp_size)]
    layouts = [EngineLayout.of(ref) for ref in references]
    buckets = plan_in_place(layouts, [(n, list(t.shape)) for n, t in hf.items()], {}, spec,
                            bucket_bytes)
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in hf.items()}
    flats = [torch.full((layout.nbytes + TRAILER,), 0xAB, dtype=torch.uint8)
             for layout in layouts]
    for b in buckets:
        slot = torch.zeros(b.nbytes + TRAILER, dtype=torch.uint8)
        for rank in range(world):
            write_shards(slot, b.tensors, [params[m.name] for m in b.tensors], rank, world)
        flats[b.rank][b.start:b.start + b.nbytes] = slot[:b.nbytes]
    # taken in rounds, rank 0's bucket j then rank 1's ...: the trainer ranks write a round
    # before one barrier (weight_sync.transport.rounds)
    per_rank = [sum(b.rank == r for b in buckets) for r in range(tp_size)]
    assert [[buckets[k].rank for k in members] for members in rounds(buckets)] == [
        [r for r in range(tp_size) if per_rank[r] > j] for j in range(max(per_rank))]
    for r, (layout, ref) in enumerate(zip(layouts, references)):
        mine = [b for b in buckets if b.rank == r]
        assert mine[0].start == 0 and mine[-1].start + mine[-1].nbytes == layout.nbytes
        assert all(a.start + a.nbytes == b.start for a, b in zip(mine, mine[1:]))  # tiled
        views = layout.views(flats[r])
        for name, want in ref.items():
            assert torch.equal(views[name], want), f"{name}, TP rank {r}/{tp_size}"
