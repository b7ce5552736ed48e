"""A step's metrics about its samples (lengths, staleness, throughput) and the rollouts it logs:
pure functions of the samples and the step's times."""
from __future__ import annotations

from rl.algo.batch import Sample


def sample_metrics(samples: list[Sample]) -> dict:
    lengths = [s.num_model_tokens for s in samples]  # the model's tokens (not the env's)
    return {"response/length_mean": sum(lengths) / len(lengths),
            "response/clip_ratio": sum(s.finish_reason == "length" for s in samples)
            / len(samples)}


def staleness_metrics(samples: list[Sample], policy_version: int) -> dict:
    """How far behind the policy each trained sample was: the update's starting version
    (policy_version - 1, once the step's sync is done) minus its first token's version."""
    versions = [s.policy_version for s in samples]
    lags = [policy_version - 1 - v for v in versions]
    return {"rollout/policy_version": float(min(versions)),
            "rollout/staleness": sum(lags) / len(lags),
            "rollout/staleness_max": float(max(lags))}


def time_metrics(step: int, batch, t0: float, t1: float, t2: float, t3: float,
                 streaming: bool) -> dict:
    """time/* and throughput/* of a step that collected `batch` (rl.run.collect) by t1,
    updated by t2 and synced by t3; streaming (async), the rollout ran beside earlier steps:
    no rollout rate."""
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.all_samples)
    metrics = {"step": step, "time/rollout": batch.seconds_generate,
               "time/reward": batch.seconds_reward, "time/update": t2 - t1, "time/sync": t3 - t2,
               "time/step": t3 - t0, "throughput/tokens_per_s": tokens / (t3 - t0)}
    if not streaming:
        metrics["rollout/tokens_per_s"] = (sum(s.num_model_tokens for s in batch.all_samples)
                                           / batch.seconds_generate)
    return metrics


def rollout_records(samples: list[Sample], texts: list[str], log_samples: int) -> list[dict]:
    """rollouts.jsonl lines: the first log_samples samples (-1: all); texts: the prompts, row:
    the prompt's index in the training rows."""
    keep = samples if log_samples < 0 else samples[:log_samples]
    return [{"row": s.row, "prompt": texts[s.row], "completion": s.text, "reward": s.reward,
             "advantage": s.advantages[0] if s.advantages else 0.0,
             "finish_reason": s.finish_reason, "policy_version": s.policy_version}
            for s in keep]
