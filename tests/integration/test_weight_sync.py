"""Sync round trip on 2 colocated workers (ZeRO-3 + vLLM each), with a tied-embedding model:
after a real update the engine's logprobs differ from the trainer's; after the sync they agree."""
import pytest
import torch

from rl.batch import Sample, collate
from rl.config import load_config
from rl.placement import Colocated
from rl.models import build_tiny_model
from update.losses import BatchCounts


@pytest.fixture(scope="module")
def tied_workers(ray_session, tmp_path_factory):
    cfg = load_config(None, ["ray.num_workers=2", "trainer.lr=0.05", "trainer.micro_batch_size=4",
                             "sync.bucket_mb=0.05"])
    path = str(build_tiny_model("tiny-llama-tied", seed=1,
                                out_dir=tmp_path_factory.mktemp("m") / "tied"))
    placement = Colocated(cfg)
    workers = placement.trainers
    ray = ray_session
    ray.get([w.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0)
             for w in workers])
    ray.get([w.init_rollout.remote(path, cfg.rollout, 0) for w in workers])
    yield ray, workers, cfg
    placement.stop()


def max_diffs(ray, workers, probe):
    return [max(abs(a - b) for a, b in zip(t, e))
            for t, e in ray.get([w.probe.remote(probe) for w in workers])]


def test_sync_round_trip_tied_embeddings(tied_workers):
    ray, workers, cfg = tied_workers
    probe = list(range(3, 60))
    assert max(max_diffs(ray, workers, probe)) < 1e-3  # same checkpoint on both sides

    gen = torch.Generator().manual_seed(0)
    batches = []
    for rank in range(2):
        samples = [Sample(0, 0, torch.randint(3, 200, (6,), generator=gen).tolist(),
                          torch.randint(3, 200, (5,), generator=gen).tolist(), [], "stop", "",
                          advantages=[float(torch.randn(1, generator=gen))] * 5)
                   for _ in range(4)]
        batches.append([collate(samples, pad_id=0)])
    old = ray.get([w.prepare.remote(b) for w, b in zip(workers, batches)])
    for b, o in zip(batches, old):
        b[0]["old_logprobs"] = o[0]["old_logprobs"]
    ray.get([w.train.remote(b, BatchCounts(40.0, 8.0)) for w, b in zip(workers, batches)])
    assert min(max_diffs(ray, workers, probe)) > 1e-3  # the update changed the policy

    stats = ray.get([w.sync_weights.remote(1, int(cfg.sync.bucket_mb * 2**20), probe, 1e-3)
                     for w in workers])
    for s in stats:
        assert s["sync/logprob_max_abs_diff"] <= 1e-3
        assert s["sync/num_buckets"] > 1  # bounded buckets, not the whole model at once
        assert s["sync/max_bucket_bytes"] <= max(cfg.sync.bucket_mb * 2**20, 128 * 384 * 4)
    assert max(max_diffs(ray, workers, probe)) <= 1e-3
