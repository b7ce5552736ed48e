"""Sync round trip on 2 colocated workers (ZeRO-3 + vLLM each), with a tied-embedding model:
after a real update the engine's logprobs differ from the trainer's; after the sync they agree."""
from contextlib import contextmanager

import pytest
import torch

from rl.algo.batch import Sample, collate
from rl.config import load_config
from rl.data.models import build_tiny_model
from update.losses import BatchCounts

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"


@contextmanager
def colocated(placements, tmp_path_factory, preset: str, seed: int, *overrides: str):
    """2 colocated workers (0.5 CPU each, from the session's pool), trainer and engine started
    from a fresh tiny model; yields (workers, cfg, placement, model path) and releases them
    after."""
    cfg = load_config(None, ["ray.num_workers=2", "ray.num_cpus_per_worker=0.5", "trainer.lr=0.05",
                             "trainer.micro_batch_size=4", *overrides])
    path = str(build_tiny_model(preset, seed=seed, out_dir=tmp_path_factory.mktemp("m") / "m"))
    import ray

    from rl.config import adapter_rank

    placement = placements.start(cfg)
    try:
        workers = placement.trainers
        ray.get([w.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0)
                 for w in workers])
        ray.get([w.init_rollout.remote(path, cfg.rollout, 0, lora_rank=adapter_rank(cfg))
                 for w in workers])
        yield workers, cfg, placement, path
    finally:
        placement.release()


@pytest.fixture
def tied_workers(ray_session, placements, tmp_path_factory):
    with colocated(placements, tmp_path_factory, "tiny-llama-tied", 1,
                   "sync.bucket_mb=0.05") as (workers, cfg, _, path):
        yield ray_session, workers, cfg, path


def max_diffs(ray, workers, probe):
    return [max(abs(a - b) for a, b in zip(t, e))
            for t, e in ray.get([w.probe.remote(probe) for w in workers])]


def update_once(ray, workers):
    """One real training step on every rank (random samples, random advantages)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in workers:
        samples = [Sample(0, 0, torch.randint(3, 200, (6,), generator=gen).tolist(),
                          torch.randint(3, 200, (5,), generator=gen).tolist(), [], "stop", "",
                          advantages=[float(torch.randn(1, generator=gen))] * 5)
                   for _ in range(4)]
        batches.append([collate(samples, pad_id=0)])
    old = ray.get([w.prepare.remote(b) for w, b in zip(workers, batches)])
    for b, o in zip(batches, old):
        b[0]["old_logprobs"] = o[0]["old_logprobs"]
    ray.get([w.train.remote(b, BatchCounts(40.0, 8.0)) for w, b in zip(workers, batches)])


def test_sync_round_trip_tied_embeddings(tied_workers):
    ray, workers, cfg, _ = tied_workers
    probe = list(range(3, 60))
    assert max(max_diffs(ray, workers, probe)) < 1e-3  # same checkpoint on both sides

    update_once(ray, workers)
    assert min(max_diffs(ray, workers, probe)) > 1e-3  # the update changed the policy

    stats = ray.get([w.sync_weights.remote(1, int(cfg.sync.bucket_mb * 2**20), probe, 1e-3)
                     for w in workers])
    for s in (report.metrics() for report in stats):
        assert s["sync/logprob_max_abs_diff"] <= 1e-3
        assert s["sync/direct_load"] == 1.0  # kept CPU weights: copied into, then re-packed
        assert s["sync/shared_weights"] == 1.0  # one copy for both engines, written in place
        assert s["sync/exact_ranges"] > 0  # and checked byte for byte
    assert max(max_diffs(ray, workers, probe)) <= 1e-3


def test_an_engine_rebuilt_beside_its_trainer_leaves_the_trainers_process_group(tied_workers):
    """vLLM's engine shutdown (also when an engine is collected) destroys the process's default
    process group, which in a colocated worker is its DeepSpeed ranks' (VLLMEngine.close keeps
    it): after the engines are rebuilt on the base model, the trainers still run ZeRO-3
    collectives (the probe's forward) and a sync brings the engines back to the trainers'."""
    ray, workers, cfg, path = tied_workers
    probe = list(range(3, 60))
    update_once(ray, workers)
    ray.get([w.init_rollout.remote(path, cfg.rollout, 0) for w in workers])
    assert min(max_diffs(ray, workers, probe)) > 1e-3  # base weights again, trainers moved on
    stats = ray.get([w.sync_weights.remote(1, int(cfg.sync.bucket_mb * 2**20), probe, 1e-3)
                     for w in workers])
    assert all(s.logprob_max_abs_diff <= 1e-3 for s in stats)


def test_packed_cpu_linears_sync_through_vllms_reload(ray_session, placements, tmp_path_factory):
    """rollout.cpu_linear=packed: vLLM's oneDNN-packed weights cannot be copied into, so the
    engines cannot share them either: the 2 ranks assemble buckets in shared memory, and each
    engine takes copies of them through vLLM's layerwise reload; it must still reach the
    trainer's logprobs."""
    ray = ray_session
    with colocated(placements, tmp_path_factory, "tiny-qwen2", 2, "rollout.cpu_linear=packed") as (
            workers, cfg, _, _):
        probe = list(range(3, 60))
        update_once(ray, workers)
        assert min(max_diffs(ray, workers, probe)) > 1e-3  # the update moved the policy
        for report in ray.get([w.sync_weights.remote(1, 2**16, probe, 1e-3) for w in workers]):
            stats = report.metrics()
            assert stats["sync/direct_load"] == 0.0 and stats["sync/shared_weights"] == 0.0
            assert stats["sync/num_buckets"] > 1  # bounded buckets, not the whole model at once
            assert stats["sync/logprob_max_abs_diff"] <= 1e-3
        assert max(max_diffs(ray, workers, probe)) <= 1e-3


@pytest.mark.parametrize("stage, dtype, tolerance, linear, eager",
                         [(2, "float32", 1e-3, "plain", True), (3, "bfloat16", 5e-2, "repack", True),
                          (0, "float32", 1e-3, "repack", True),
                          (3, "float32", 1e-3, "repack", False)])
def test_sync_from_other_zero_stages_and_bf16(ray_session, placements, tmp_path_factory, stage,
                                              dtype, tolerance, linear, eager):
    """ZeRO-2 and stage 0 keep parameters whole on every rank (each rank writes an equal range of
    them into the engines' shared weights); a bf16 trainer writes its bf16 shards into float32
    engines.
    Engines with plain CPU linears compute straight from the weights written in place. A
    compiled engine (enforce_eager=false: vLLM's inductor graph) reads the parameters it was
    traced with, rebound to the shared copy and re-packed after the write, on every call."""
    ray = ray_session
    with colocated(placements, tmp_path_factory, "tiny-qwen2", 3, f"trainer.zero_stage={stage}",
                   f"trainer.dtype={dtype}", "sync.bucket_mb=0.05",
                   f"rollout.cpu_linear={linear}", f"rollout.enforce_eager={eager}") as (
            workers, cfg, _, _):
        assert ray.get(workers[0].__ray_call__.remote(
            lambda w: w.rollout_role.engine.eager)) == eager
        probe = list(range(3, 60))
        update_once(ray, workers)
        before = min(max_diffs(ray, workers, probe))
        stats = ray.get([w.sync_weights.remote(1, 2**16, probe, tolerance) for w in workers])
        after = max(max_diffs(ray, workers, probe))
        assert after <= tolerance < before
        assert all(s.ways == {"direct_load": True, "shared_weights": True} for s in stats)


def _snapshot(self, key: str) -> None:
    """(On a worker) keep a copy of the engine's weights under `key`."""
    self.__dict__.setdefault("_snapshots", {})[key] = {
        n: p.clone() for n, p in self.rollout_role.engine.parameters().items()}


def _restore(self, key: str, prefixes: tuple[str, ...]) -> None:
    """(On a worker) put back the kept copy of the parameters whose names start so."""
    for name, p in self.rollout_role.engine.parameters().items():
        if name.startswith(prefixes):
            p.copy_(self._snapshots[key][name])
    self.rollout_role.engine.weights_changed()


def _corrupt(self, name: str) -> None:
    """(On a worker) garbage in a quarter of one parameter: what a corrupted bucket leaves."""
    p = self.rollout_role.engine.parameters()[name]
    flat = p.view(-1)
    flat[: flat.numel() // 4] = torch.randn(flat.numel() // 4, generator=torch.Generator()
                                            .manual_seed(0)).to(p.dtype)
    self.rollout_role.engine.weights_changed()


@pytest.mark.parametrize("trainer_dtype", ["bfloat16", "float32"])
def test_the_bf16_probe_tolerance_still_catches_a_stale_head_a_stale_layer_and_a_corrupt_bucket(
        ray_session, placements, tmp_path_factory, trainer_dtype):
    """bf16 engines score the probe off the trainer by a noise that depends on the model; the
    tolerance follows the noise measured at start-up (both sides hold the base model), and
    after one real update these three faults on one rank's engine are still caught."""
    from weight_sync.verify import SyncVerificationError, check_logprobs

    ray = ray_session
    with colocated(placements, tmp_path_factory, "tiny-llama-tied", 4, "rollout.dtype=bfloat16",
                   f"trainer.dtype={trainer_dtype}", "trainer.bf16_mode=autocast") as (
            workers, cfg, placement, _):
        probe = list(range(3, 60))
        start = placement.measure_probe_noise(probe)
        tolerance = start["sync/tolerance"]
        assert 0 < start["sync/probe_noise"] < tolerance < 1.0  # bf16's, and scaled to this model
        ray.get([w.__ray_call__.remote(_snapshot, "base") for w in workers])
        update_once(ray, workers)
        stats = placement.sync(1, probe)
        assert stats["sync/tolerance"] == tolerance
        faults = {"stale tied head": lambda w: w.__ray_call__.remote(
                      _restore, "base", ("model.embed_tokens.", "lm_head.")),
                  "stale layer": lambda w: w.__ray_call__.remote(
                      _restore, "base", ("model.layers.1.",)),
                  "corrupt bucket": lambda w: w.__ray_call__.remote(
                      _corrupt, "model.layers.0.mlp.down_proj.weight")}
        missed = {}
        for fault, apply in faults.items():
            ray.get([w.__ray_call__.remote(_snapshot, "synced") for w in workers])
            ray.get(apply(workers[0]))  # rank 0's engine goes wrong
            # the trainer's probe is a collective under ZeRO-3: both ranks score it
            trainer, engine = ray.get([w.probe.remote(probe) for w in workers])[0]
            try:
                check_logprobs(trainer, engine, tolerance, "rank 0")
                missed[fault] = max(abs(a - b) for a, b in zip(trainer, engine))
            except SyncVerificationError:
                pass
            ray.get(workers[0].__ray_call__.remote(_restore, "synced", ("",)))
        assert not missed, (missed, tolerance)


def _differing(self, key: str, prefixes: tuple[str, ...]) -> int:
    """(On a worker) elements of the parameters whose names start so that differ from the kept
    copy."""
    params = self.rollout_role.engine.parameters()
    return sum(int((p != self._snapshots[key][n]).sum())
               for n, p in params.items() if n.startswith(prefixes))


def test_the_exact_check_catches_a_stale_bf16_layer_after_one_step_at_the_recipes_lr(
        ray_session, placements, tmp_path_factory):
    """bf16 trainer and engines, one step at smollm2_chain_sum.yaml's lr (1e-5): rank 0's engine
    keeps layer 1's bytes from before the step (a missed write). The probe, whose bf16 tolerance
    must cover rounding noise, sees too small a change to be sure of it; the exact check after
    the sync (weight_sync.exact) names the layer."""
    from weight_sync.exact import ExactCheckError
    from weight_sync.verify import SyncVerificationError, check_logprobs

    ray = ray_session
    with colocated(placements, tmp_path_factory, "tiny-llama-tied", 4, "rollout.dtype=bfloat16",
                   "trainer.dtype=bfloat16", "trainer.lr=1e-5") as (workers, cfg, placement, _):
        probe = list(range(3, 60))
        tolerance = placement.measure_probe_noise(probe)["sync/tolerance"]
        ray.get([w.__ray_call__.remote(_snapshot, "base") for w in workers])
        update_once(ray, workers)
        stats = placement.sync(1, probe)
        assert stats["sync/exact_ranges"] > 0 and stats["sync/shared_weights"] == 1.0
        layer = ("model.layers.1.",)
        changed = ray.get(workers[0].__ray_call__.remote(_differing, "base", layer))
        assert changed > 0  # the step moved some of the layer's bf16 values
        ray.get(workers[0].__ray_call__.remote(_restore, "base", layer))
        trainer, engine = ray.get([w.probe.remote(probe) for w in workers])[0]
        try:
            check_logprobs(trainer, engine, tolerance, "rank 0")
            seen = "missed"
        except SyncVerificationError:
            seen = "caught"
        diff = max(abs(a - b) for a, b in zip(trainer, engine))
        print(f"stale layer 1 ({changed} bf16 values): the probe {seen} it "
              f"(|Δ| {diff:.3g}, tolerance {tolerance:.3g})")
        with pytest.raises(ExactCheckError, match="model.layers.1."):
            ray.get([w.check_shared_exact.remote() for w in workers])
