"""Disaggregated placement on the real engines: 2 DeepSpeed ZeRO-3 trainer ranks and 2 vLLM
engines in actors of their own, weights broadcast over gloo from trainer rank 0.

A sync after a real update makes every engine score the probe like the trainer (tied-embedding
model); a flipped byte on the wire is caught, the engine refuses to generate until a good
sync; and a short rl-train run matches the colocated run with the same seed."""

import pytest
import torch

from rl.algo.batch import Sample, collate
from rl.config import load_config
from rl.data.models import build_tiny_model
from tests.faults import corrupt_next_send_on_actor
from update.losses import BatchCounts
from weight_sync.transport import WeightSyncError

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

SMALL_RAY = ["ray.num_workers=2", "ray.num_rollout_workers=2", "ray.num_cpus_per_worker=0.5",
             "ray.num_cpus_per_rollout_worker=0.5"]


@pytest.fixture(scope="module")
def pools(ray_session, placements, tmp_path_factory):
    cfg = load_config(None, SMALL_RAY + ["placement=disaggregated", "trainer.lr=0.05",
                                         "trainer.micro_batch_size=4", "sync.bucket_mb=0.05"])
    path = str(build_tiny_model("tiny-llama-tied", seed=1,
                                out_dir=tmp_path_factory.mktemp("m") / "tied"))
    placement = placements.start(cfg)
    ray = ray_session
    ray.get([t.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0)
             for t in placement.trainers])
    placement.init_rollout(path, version=0)
    yield ray, placement
    placement.release()


def engine_diffs(ray, placement, probe):
    trainer = ray.get([t.trainer_logprobs.remote(probe) for t in placement.trainers])[0]
    return [max(abs(a - b) for a, b in zip(trainer, lps))
            for lps in ray.get([e.score_tokens.remote(probe) for e in placement.engines])]


def train_once(ray, placement):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in placement.trainers:
        samples = [Sample(0, 0, torch.randint(3, 200, (6,), generator=gen).tolist(),
                          torch.randint(3, 200, (5,), generator=gen).tolist(), [], "stop", "",
                          advantages=[float(torch.randn(1, generator=gen))] * 5)
                   for _ in range(4)]
        batches.append([collate(samples, pad_id=0)])
    old = ray.get([t.prepare.remote(b) for t, b in zip(placement.trainers, batches)])
    for b, o in zip(batches, old):
        b[0]["old_logprobs"] = o[0]["old_logprobs"]
    ray.get([t.train.remote(b, BatchCounts(40.0, 8.0))
             for t, b in zip(placement.trainers, batches)])


def test_broadcast_sync_after_an_update_reaches_every_engine(pools):
    ray, placement = pools
    probe = list(range(3, 60))
    assert max(engine_diffs(ray, placement, probe)) < 1e-3  # same checkpoint everywhere
    train_once(ray, placement)
    assert min(engine_diffs(ray, placement, probe)) > 1e-3  # the update moved the policy
    stats = placement.sync(1, probe)
    assert stats["sync/logprob_max_abs_diff"] <= 1e-3  # checked on every engine
    assert stats["sync/direct_load"] == 1.0 and stats["sync/in_place"] == 1.0  # no receive copy
    assert stats["sync/exact_ranges"] > 0  # every engine checked byte for byte
    assert stats["sync/num_buckets"] > 1  # bounded buckets, back to back
    assert stats["sync/max_bucket_bytes"] <= max(0.05 * 2**20, 128 * 384 * 4 + 16)
    assert max(engine_diffs(ray, placement, probe)) <= 1e-3
    out = ray.get(placement.engines[0].generate.remote([probe[:8]], [1], version=1))
    assert out["policy_version"] == 1


def test_a_corrupted_bucket_is_detected_and_the_engine_refuses_to_generate(pools):
    ray, placement = pools
    probe = list(range(3, 60))
    train_once(ray, placement)
    ray.get(placement.trainers[0].__ray_call__.remote(corrupt_next_send_on_actor, 1))
    with pytest.raises(WeightSyncError, match=r"bucket 1/\d+ .* failed its sum64 check"):
        placement.sync(2, probe)
    with pytest.raises(WeightSyncError, match="holds policy version None"):
        ray.get(placement.engines[0].generate.remote([probe[:8]], [1], version=2))
    stats = placement.sync(2, probe)  # a clean retry of the same version repairs it
    assert stats["sync/logprob_max_abs_diff"] <= 1e-3
    assert ray.get(placement.engines[1].generate.remote([probe[:8]], [1], version=2))[
        "policy_version"] == 2
    with pytest.raises(WeightSyncError, match="expected 3"):  # a missed sync is no silent stale
        ray.get(placement.engines[1].generate.remote([probe[:8]], [1], version=3))


def _nudge(self, name: str) -> None:
    """(On an engine) one step of the last representable value of one element: what a missed
    write of a small update leaves."""
    flat = self.rollout_role.engine.parameters()[name].view(-1)
    flat[-1:] = torch.nextafter(flat[-1:], flat[-1:] + 1)


def test_one_element_an_engine_holds_apart_from_the_trainer_is_named(pools):
    """After an in-place sync the engines' bytes are checked against the trainer ranks' (the
    probe could not see one float32 ulp); one element off on engine 1 is named, and the next
    sync repairs it."""
    from weight_sync.exact import ExactCheckError

    ray, placement = pools
    probe = list(range(3, 60))
    train_once(ray, placement)
    placement.sync(3, probe)
    assert placement.check_exact()[1] > 0
    name = "model.layers.0.mlp.down_proj.weight"
    ray.get(placement.engines[1].__ray_call__.remote(_nudge, name))
    with pytest.raises(ExactCheckError, match="rollout engine 1: .*1 of .*down_proj"):
        placement.check_exact()
    assert placement.sync(4, probe)["sync/exact_ranges"] > 0
