"""Assembling buckets from ZeRO-3-style shards (padded at the end, as DeepSpeed lays them out)
on a real 2-process gloo world; sizes that do not divide by the world size exercise the padding.

ShardGather: the shards come back whole on rank 0, in their places in the flat bucket (and
whole on every rank from the trainer's own gather, update.zero.gathered_weights).
NodeBuckets: each rank writes only its own shard (or, for parameters kept whole, its own element
range) and after `publish()` both ranks read every bucket whole from shared memory, through the
two alternating slots; ranks on two hosts get None.
SharedWeights: each rank writes its shards straight into engine-layout weights (fused q/k/v,
padded and tied vocab) shared by both; a parameter never sent fails the write on every rank."""
import socket

import pytest

import torch
import torch.distributed as dist

from tests.spawn import World
from weight_sync.layout import new_buffer, plan_layout, unflatten
from weight_sync.node_buckets import NodeBuckets
from weight_sync.shard_gather import ShardGather, shards_to_rank0

SHAPES = [(3, 5), (7,), (4, 4), (1,)]  # 15, 7, 16, 1 elements: odd sizes leave padding


def full_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen) for s in SHAPES]


def shard(full: torch.Tensor, rank: int, world: int) -> torch.nn.Parameter:
    """A parameter as ZeRO-3 leaves it: empty data, rank's slice of the padded flat tensor."""
    size = -(-full.numel() // world)
    padded = torch.zeros(size * world)
    padded[:full.numel()] = full.view(-1)
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor = padded[rank * size:(rank + 1) * size].clone()
    p.ds_numel, p.ds_numel_aligned, p.ds_shape = full.numel(), size * world, full.shape
    return p


def run(rank: int, world: int, port: int, mode: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fulls = full_tensors()
        params = [shard(f, rank, world) for f in fulls]
        assert shards_to_rank0(params), "ZeRO-3 shards over the whole world must qualify"
        layout = plan_layout([(f"p{i}", list(f.shape), f.dtype) for i, f in enumerate(fulls)],
                             bucket_bytes=80, version=1, checksum="sum64")
        gather = ShardGather()
        index = 0
        for bucket in layout.buckets:
            ps = params[index:index + len(bucket.tensors)]
            index += len(bucket.tensors)
            buffer = new_buffer(bucket, "cpu") if rank == 0 else None
            gather.gather(ps, buffer, bucket)
            if rank == 0:
                for name, t in unflatten(buffer, bucket):
                    out[name] = t.clone()
        # the trainer's own gather (update.zero), by the same layout rule: whole on every rank
        from update.zero import gathered_weights

        whole = gathered_weights({f"p{i}": p for i, p in enumerate(params)})
        out.update({f"rank{rank}.p{i}": whole[f"p{i}"].clone() for i in range(len(fulls))})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawn():
    """spawn(target, mode): target(rank, 2, port, mode, out) in two processes of one gloo
    world (kept for the module's tests); returns out."""
    # 180 s: beside the early runs (the vs_trl smoke's 8 rows start with the unit tests) the
    # first call, which starts the world, took 59 s and once more than 60 (a flake, not a hang)
    with World(2, timeout_s=180) as world:
        yield lambda target, mode="": world.run(target, mode)


def test_shards_come_back_whole_on_rank_0(spawn):
    got = spawn(run)
    for i, full in enumerate(full_tensors()):
        assert torch.equal(got[f"p{i}"], full), i
        for rank in range(2):  # update.zero.gathered_weights: on every rank
            assert torch.equal(got[f"rank{rank}.p{i}"], full), (rank, i)


def test_parameters_that_are_not_shards_fall_back_to_deepspeed():
    assert not shards_to_rank0([torch.nn.Parameter(torch.zeros(3))])


def run_node(rank: int, world: int, port: int, mode: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import weight_sync.node_buckets as nb

    hostname, create = socket.gethostname, nb._create  # put back after: the process is kept
    try:
        if mode == "two_hosts" and rank == 1:
            socket.gethostname = lambda: "another-host"
        if mode == "no_room":
            nb._create = lambda path, nbytes: False  # /dev/shm too small (rank 0 decides)
        fulls = full_tensors()
        params = ([shard(f, rank, world) for f in fulls] if mode == "zero3"
                  else [torch.nn.Parameter(f.clone()) for f in fulls])
        layout = plan_layout([(f"p{i}", list(f.shape), f.dtype) for i, f in enumerate(fulls)],
                             bucket_bytes=40, version=1, checksum="sum64")
        assert len(layout.buckets) > NodeBuckets.ROUNDS, "every slot gets reused"
        slot = max(b.nbytes for b in layout.buckets) + 8
        shared = NodeBuckets.create(slot)
        if mode in ("two_hosts", "no_room"):
            out[f"{rank}:created"] = shared is not None
            return
        assert NodeBuckets.reuse(shared, slot) is shared  # big enough: kept
        index = 0
        for k, bucket in enumerate(layout.buckets):
            ps = params[index:index + len(bucket.tensors)]
            index += len(bucket.tensors)
            buffer = shared.write(k, bucket, ps)
            shared.publish()
            for name, t in unflatten(buffer, bucket):
                out[f"{rank}:{name}"] = t.clone()
    finally:
        socket.gethostname, nb._create = hostname, create
        dist.destroy_process_group()


def test_every_rank_reads_every_bucket_whole_from_its_shards(spawn):
    got = spawn(run_node, "zero3")
    for rank in range(2):
        for i, full in enumerate(full_tensors()):
            assert torch.equal(got[f"{rank}:p{i}"], full), (rank, i, SHAPES[i])


def test_parameters_kept_whole_are_split_between_the_writers(spawn):
    got = spawn(run_node, "whole")
    for i, full in enumerate(full_tensors()):
        assert torch.equal(got[f"1:p{i}"], full), i


@pytest.mark.parametrize("mode", ["two_hosts", "no_room"])
def test_ranks_on_two_hosts_or_without_room_get_none(spawn, mode):
    assert spawn(run_node, mode) == {"0:created": False, "1:created": False}


def test_a_file_that_does_not_fit_is_refused_and_removed(tmp_path):
    from weight_sync.node_buckets import _create

    path = tmp_path / "slots"
    assert not _create(str(path), 2**60) and not path.exists()  # an exabyte: no file system
    assert _create(str(path), 4096) and path.stat().st_size == 4096


HF_SHAPES = {"model.embed_tokens.weight": (100, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
             "model.layers.0.self_attn.k_proj.weight": (8, 16),
             "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.norm.weight": (16,)}


def hf_model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randn(*s, generator=gen) for n, s in HF_SHAPES.items()}


def engine_params() -> dict[str, torch.Tensor]:
    """A vLLM-style engine: fused q/k/v, vocab padded to 128 rows, the head tied to it."""
    embed = torch.zeros(128, 16)
    embed[100:] = 7.0  # padding rows: never sent, they must keep the engine's values
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed.view_as(embed),
            "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(32, 16),
            "model.norm.weight": torch.zeros(16)}


def module_with(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, p)
    return root


def run_shared(rank: int, world: int, port: int, mode: str, out) -> None:
    from weight_sync.direct import DirectLoadError
    from weight_sync.resharding import TPSpec
    from weight_sync.shared_weights import SharedWeights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        spec = TPSpec(1, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=32,
                      vocab_size=100)
        hf = {n: t for n, t in hf_model().items() if not (mode == "missing" and "v_proj" in n)}
        module = module_with({n: shard(t, rank, world) for n, t in hf.items()})
        shared = SharedWeights.create(engine_params(), spec)
        assert shared.views["lm_head.weight"].data_ptr() == \
            shared.views["model.embed_tokens.weight"].data_ptr(), "a tied head stays tied"
        try:
            shared.write(module, {"lm_head.weight": "model.embed_tokens.weight"})
        except DirectLoadError as e:
            out[f"{rank}:error"] = str(e)
            return
        for name, view in shared.views.items():
            out[f"{rank}:{name}"] = view.clone()
    finally:
        dist.destroy_process_group()


def test_shared_engine_weights_hold_every_shard_at_its_slot_for_both_ranks(spawn):
    hf, got = hf_model(), spawn(run_shared, "all")
    qkv = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    for rank in range(2):
        assert torch.equal(got[f"{rank}:model.layers.0.self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(got[f"{rank}:model.embed_tokens.weight"][:100],
                           hf["model.embed_tokens.weight"])
        assert (got[f"{rank}:model.embed_tokens.weight"][100:] == 7.0).all(), "padding kept"
        assert torch.equal(got[f"{rank}:model.norm.weight"], hf["model.norm.weight"])


def test_a_parameter_the_trainer_does_not_send_fails_the_write_on_every_rank(spawn):
    got = spawn(run_shared, "missing")
    # engine: vocab 100 x 16 (padding not counted) + qkv 32 x 16 + norm 16 = 2128; no v: -8 x 16
    for rank in range(2):
        assert "wrote 2000 elements of the shared engine weights, the engine has 2128" in \
            got[f"{rank}:error"]
