"""What every recipe's run must log, whichever test runs the recipe end to end."""
import math


def check_step_metrics(cfg, lines: list[dict]) -> None:
    """Each training step's metrics (metrics.jsonl lines of RL steps, evaluations left out):
    finite, the sync checked, the engine's logprobs against the trainer's, and the keys that
    the algorithm's parts add (KL, a critic, dynamic sampling)."""
    assert lines, "no RL step was logged"
    for m in lines:
        bad = {k: v for k, v in m.items() if not math.isfinite(v)}
        assert not bad, bad
        assert m["sync/logprob_max_abs_diff"] <= m["sync/tolerance"]
        assert "mismatch/kl" in m and "mismatch/max_abs_diff" in m
        if cfg.algorithm.loss.kl_coef > 0:
            assert "kl/mean" in m
        if cfg.algorithm.critic:
            assert "loss/value" in m and "values/mean" in m
        if cfg.algorithm.dynamic_sampling:
            assert m["dynamic/rounds"] >= 1
