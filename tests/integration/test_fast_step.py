"""The fastest real-engine checks, kept in the fast tier (`pytest -m "not slow"`): on the
quickstart's placement (2 colocated Ray workers, each a DeepSpeed ZeRO-3 rank and a vLLM
engine, on a tiny local model) one generate, one update and one weight sync verified by its
probe, with the policy versions the engines then hold."""
import os
from pathlib import Path

import pytest
import torch

from rl.algo.batch import Sample, collate
from rl.config import load_config
from rl.data.models import build_tiny_model
from update.losses import BatchCounts
from weight_sync.transport import WeightSyncError

ROOT = Path(__file__).parents[2]


def test_generate_update_then_a_verified_sync(ray_session, placements, tmp_path):
    ray = ray_session
    cfg = load_config(str(ROOT / "recipes" / "quickstart.yaml"), [
        "ray.num_cpus_per_worker=0.5", "trainer.lr=0.05", "trainer.micro_batch_size=8",
        "rollout.n=4", "rollout.max_new_tokens=6"])
    assert cfg.trainer.zero_stage == 3 and cfg.ray.num_workers == 2  # the quickstart's
    path = str(build_tiny_model("tiny-qwen2", seed=7, out_dir=tmp_path / "m"))
    placement = placements.start(cfg)
    try:
        workers = placement.trainers
        # at the driver's priority, not Ray's nice 15 (rl.run.cluster.init_local)
        assert ray.get([w.__ray_call__.remote(lambda self: os.nice(0)) for w in workers]) == [
            os.nice(0)] * 2
        ray.get([w.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0)
                 for w in workers])
        placement.init_rollout(path, 0)
        probe = list(range(3, 60))

        # generate: each engine samples n responses to its prompt, with their logprobs
        prompts = [[5, 17, 23, 42, 7], [9, 31, 8]]
        outs = ray.get([w.generate.remote([p], [i], version=0)
                        for i, (w, p) in enumerate(zip(workers, prompts))])
        samples = []
        for p, out in zip(prompts, outs):
            assert out["policy_version"] == 0
            (group,) = out["groups"]
            assert len(group) == 4
            for c in group:
                assert 1 <= len(c["token_ids"]) == len(c["logprobs"]) <= 6
                assert all(lp <= 0.0 for lp in c["logprobs"])
                samples.append(Sample(0, 0, p, c["token_ids"], c["logprobs"],
                                      c["finish_reason"], c["text"]))

        # update: one ZeRO-3 step on each rank's 4 samples moves the policy off the engines'
        gen = torch.Generator().manual_seed(0)
        for s in samples:
            s.advantages = [float(torch.randn(1, generator=gen))] * len(s.response_ids)
        batches = [[collate(samples[:4], 0)], [collate(samples[4:], 0)]]
        old = ray.get([w.prepare.remote(b) for w, b in zip(workers, batches)])
        for b, o in zip(batches, old):
            b[0]["old_logprobs"] = o[0]["old_logprobs"]
        tokens = float(sum(len(s.response_ids) for s in samples))
        metrics = ray.get([w.train.remote(b, BatchCounts(tokens, 8.0))
                           for w, b in zip(workers, batches)])
        assert all(m["grad_norm"] > 0 for m in metrics)
        moved = [max(abs(a - b) for a, b in zip(t, e)) for t, e in placement.probe_pairs(probe)]
        assert min(moved) > 1e-3, moved

        # sync: every engine holds version 1 and scores the probe as the trainer does
        stats = placement.sync(1, probe)
        assert stats["sync/logprob_max_abs_diff"] <= stats["sync/tolerance"] == 1e-3
        after = [max(abs(a - b) for a, b in zip(t, e)) for t, e in placement.probe_pairs(probe)]
        assert max(after) <= 1e-3, after
        assert ray.get(workers[1].generate.remote([prompts[0]], [3], version=1))[
            "policy_version"] == 1
        with pytest.raises(WeightSyncError, match="holds policy version 1"):
            ray.get(workers[0].generate.remote([prompts[0]], [3], version=2))
    finally:
        placement.release()
