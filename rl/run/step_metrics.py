"""A step's metrics about its samples (lengths, staleness, throughput) and the rollouts it logs:
pure functions of the samples and the step's times."""
from __future__ import annotations

from rl.algo.batch import Sample


def sample_metrics(samples: list[Sample]) -> dict:
    lengths = [s.num_model_tokens for s in samples]  # the model's tokens (not the env's)
    return {"response/length_mean": sum(lengths) / len(lengths),
            "response/clip_ratio": sum(s.finish_reason == "length" for s in samples)
            / len(samples)}


def env_metrics(samples: list[Sample]) -> dict:
    """Multi-turn: per trajectory, its model turns and each count its env summed over its steps
    (env/tool_calls, env/tool_errors, env/env_seconds, env/env_errors, ...), the fraction that
    a limit cut or an env failure ended, and the fraction of response tokens that are the
    env's (masked out of the loss)."""
    n = len(samples)
    keys = sorted({k for s in samples for k in s.env_info})
    response = sum(len(s.response_ids) for s in samples)
    out = {"env/turns": sum(s.turns for s in samples) / n,
           "env/truncated_frac": sum(s.truncated for s in samples) / n,
           "env/failed_frac": sum(bool(s.env_error) for s in samples) / n,
           "env/masked_token_frac": 1.0 - sum(s.num_model_tokens for s in samples)
           / max(response, 1)}
    # a handler's own metrics name their group (agent/prefix_breaks); the others are env/'s
    out.update({k if "/" in k else f"env/{k}": sum(s.env_info.get(k, 0) for s in samples) / n
                for k in keys})
    return out


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


def conversation(response_ids: list[int], loss_mask: list[int], decode) -> list[dict]:
    """A multi-turn response as its turns: {"model": text} for each run of the model's tokens,
    {"env": text} for each observation between them (decode(ids): the text with the
    template's special tokens, which mark the roles)."""
    mask = loss_mask or [1] * len(response_ids)
    turns, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            turns.append({"model" if mask[start] else "env": decode(response_ids[start:i])})
            start = i
    return turns


def rollout_records(samples: list[Sample], texts: list[str], log_samples: int,
                    decode=None) -> list[dict]:
    """rollouts.jsonl lines: the first log_samples samples (-1: all); texts: the prompts, row:
    the prompt's index in the training rows. Multi-turn (decode given): the whole conversation
    with its turns marked, and how it ended."""
    keep = samples if log_samples < 0 else samples[:log_samples]
    records = []
    for s in keep:
        record = {"row": s.row, "prompt": texts[s.row], "completion": s.text, "reward": s.reward,
                  "advantage": s.advantages[0] if s.advantages else 0.0,
                  "finish_reason": s.finish_reason, "policy_version": s.policy_version}
        if decode is not None:
            record.update({"conversation": conversation(s.response_ids, s.loss_mask, decode),
                           "turns": s.turns,
                           "truncated": s.truncated, "env_error": s.env_error,
                           "trained": s.trained, "env_info": s.env_info})
        records.append(record)
    return records
