"""The shared-prompt update (each prompt run once, its responses on the cached keys and values)
equals the full layout's on real DeepSpeed ZeRO-3 engines, 2 ranks over gloo as in the
quickstart: same old and reference logprobs, loss, KL, grad norm and updated weights."""
import pytest

from tests.spawn import spawn_world

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"


def rank_samples(rank: int, world_size: int, shortest: int = 1) -> tuple[list, object]:
    """This rank's 3 prompts x 4 samples (responses of `shortest`-6 tokens) and the global
    BatchCounts."""
    import random

    from rl.algo.batch import Sample
    from update.losses import BatchCounts

    rng = random.Random(rank)
    samples = []
    for g in range(3):
        prompt = [rng.randrange(5, 300) for _ in range(6 + 3 * g)]
        for _ in range(4):
            response = [rng.randrange(5, 300) for _ in range(rng.randint(shortest, 6))]
            samples.append(Sample(g, g, prompt, response, [-rng.uniform(1, 3) for _ in response],
                                  "stop", "", advantages=[rng.uniform(-1, 1)] * len(response)))
    counts = BatchCounts(float(sum(len(s.response_ids) for s in samples) * world_size), 24.0)
    return samples, counts


def _compare(rank: int, world_size: int, port: int, path: str, out) -> None:
    import torch

    from rl.algo.batch import collate
    from update.config import LossConfig, TrainerConfig
    from update.trainer import PolicyTrainer, full_state_dict, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port)
    samples, counts = rank_samples(rank, world_size)
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=12, zero_stage=3)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3")
    results = {}
    for share in (False, True):
        trainer = PolicyTrainer(path, cfg, loss_cfg, grad_accum=1)
        batch = collate(samples, 0, share_prompts=share)
        prepared = trainer.prepare([batch])[0]
        metrics = trainer.train_step([batch], counts)
        state = full_state_dict(trainer.engine, cfg)
        results[share] = (trainer.share_prompts, prepared, metrics,
                          {k: v.clone() for k, v in state.items()} if state else None)
    (on0, prep0, m0, w0), (on1, prep1, m1, w1) = results[False], results[True]
    mask = collate(samples, 0)["response_mask"]
    out[rank] = {
        "shared_on": on1, "prompt_rows": int(collate(samples, 0, True)["prompt_ids"].shape[0]),
        "logprob_diff": max(float(((prep1[k] - prep0[k]).abs() * mask).max()) for k in prep0),
        "magnitude": max(float((prep0[k].abs() * mask).max()) for k in prep0),
        "metrics": {k: (m0[k], m1[k]) for k in m0},
        "update_diff": _update_diff(w0, w1, _initial(path)) if w0 else None}


def _update_diff(w0: dict, w1: dict, initial: dict) -> tuple[float, float]:
    """(|update 0|, |update 1 - update 0| / |update 0|) over all weights, L2: Adam turns a
    rounding of a gradient near zero into a step of up to lr (tests/numerics.adam_update)."""
    import torch

    d0 = torch.cat([(w0[k] - initial[k]).flatten() for k in initial if k in w0])
    d1 = torch.cat([(w1[k] - initial[k]).flatten() for k in initial if k in w0])
    return float(d0.norm()), float((d1 - d0).norm() / d0.norm())


def _initial(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


@pytest.mark.integration
def test_shared_prompt_update_equals_the_full_layout_on_two_zero3_ranks(tmp_path):
    from transformers import AutoConfig

    from rl.data.models import build_tiny_model
    from tests.numerics import adam_update, depth, rounding, width

    path = build_tiny_model("tiny-qwen2", out_dir=tmp_path / "model")  # once, before the ranks
    out = spawn_world(_compare, 2, str(path))
    config = AutoConfig.from_pretrained(path)
    for rank in (0, 1):
        r = out[rank]
        assert r["shared_on"], "the start-up check turned prompt sharing off on a Qwen2 model"
        assert r["prompt_rows"] == 3  # 12 samples, 3 prompts: each prompt runs once
        # old and reference logprobs: other attention shapes, the same values within rounding
        tol = rounding(r["magnitude"], depth(config), width(config))
        assert r["logprob_diff"] <= tol, (r["logprob_diff"], tol)
        for key in ("loss/policy", "loss/kl", "kl/mean", "mismatch/kl", "grad_norm"):
            full, shared = r["metrics"][key]  # each from logprobs of that magnitude (or its own)
            bound = rounding(max(r["magnitude"], abs(full)), depth(config), width(config))
            assert abs(shared - full) <= bound, (rank, key, full, shared)
    moved, relative = out[0]["update_diff"]
    assert moved > 1e-2, "the step must change the weights for the comparison to mean much"
    assert relative <= adam_update(depth(config), width(config)), relative
