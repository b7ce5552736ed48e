"""Collecting a rollout batch: generate, score, shape, and (DAPO) keep only informative groups."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rl.algo.batch import Sample, chunk


def generate_spread(engines: list, prompts, rows: list[int], seeds: list[int],
                    **kwargs) -> list[tuple[list[int], dict]]:
    """Generate for prompt `rows` of `prompts` (an rl.data.prompts.PromptSet; one seed each),
    spread in order over the engines in contiguous parts (the last engines sit out when there
    are fewer prompts), kwargs passed to each engine's `generate`; returns (the positions in
    `rows` each engine took, its result) in order."""
    import ray

    parts = [p for p in chunk(list(range(len(rows))), len(engines)) if p]
    futures = [e.generate.remote(**prompts.request([rows[i] for i in part],
                                                   [seeds[i] for i in part]), **kwargs)
               for e, part in zip(engines, parts)]
    return list(zip(parts, ray.get(futures)))


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -penalty."""
    start = max_len - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


def mask_untrained(samples: list[Sample], train_truncated: bool) -> int:
    """Multi-turn: take out of the loss every token of a trajectory its environment failed
    (the model is not to blame) and, unless train_truncated, of one a limit cut (`trained`
    False). They keep their reward, so their group's statistics still count them. Returns how
    many."""
    for s in samples:
        s.trained = not (s.env_error or (s.truncated and not train_truncated))
    return sum(not s.trained for s in samples)


def is_flat(group: list[Sample]) -> bool:
    """All scores equal: group-relative advantages are 0, the group carries no signal."""
    return max(s.score for s in group) - min(s.score for s in group) < 1e-9


def reward_summary(samples: list[Sample], overlong_buffer: int) -> dict:
    """reward/mean and reward/std (and the shaped mean under overlong shaping) of `samples`."""
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    out = {"reward/mean": mean,
           "reward/std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5}
    if overlong_buffer:
        out["reward/shaped_mean"] = sum(s.score for s in samples) / len(rewards)
    return out


@dataclass
class Collected:
    samples: list[Sample]  # exactly prompts_per_step groups of n, contiguous
    all_samples: list[Sample]  # everything generated this step (for honest reward metrics)
    metrics: dict = field(default_factory=dict)
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    # the engines' counters (the last round's); async: the trainer's wait for the batch
    engine_stats: dict = field(default_factory=dict)


def collect(cfg, next_rows, generate, score) -> Collected:
    """Rollout rounds until the batch holds prompts_per_step groups (one round unless dynamic
    sampling); the shortfall after max_sampling_rounds is filled with flat groups.
    next_rows(k): the next k prompt rows; generate(rows, round_index) -> (samples, engine
    counters); score(samples) -> reward metrics, each sample rewarded in place."""
    algo = cfg.algorithm
    want, n = cfg.rollout.prompts_per_step, cfg.rollout.n
    kept: list[list[Sample]] = []
    flat: list[list[Sample]] = []
    out = Collected([], [])
    rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
    reward_metrics: list[dict] = []
    for round_index in range(rounds):
        t0 = time.perf_counter()
        samples, out.engine_stats = generate(next_rows(want), round_index)
        t1 = time.perf_counter()
        reward_metrics.append(score(samples))
        out.seconds_generate += t1 - t0
        out.seconds_reward += time.perf_counter() - t1
        out.all_samples += samples
        for group in chunk(samples, len(samples) // n):
            (flat if algo.dynamic_sampling and is_flat(group) else kept).append(group)
        if len(kept) >= want:
            break
    filled = max(0, want - len(kept))
    groups = kept[:want] + flat[:filled]
    for g, group in enumerate(groups):
        for s in group:
            s.group = g
    out.samples = [s for group in groups for s in group]
    counts = ("reward/errors", "reward/timeouts")
    # per-term means averaged over rounds (equal sizes); failure counts added up
    out.metrics = {k: sum(m[k] for m in reward_metrics) / (1 if k in counts else
                                                             len(reward_metrics))
                   for k in reward_metrics[0]}
    out.metrics.update(reward_summary(out.all_samples, algo.overlong_buffer))
    if algo.dynamic_sampling:
        out.metrics.update({"dynamic/rounds": float(round_index + 1),
                            "dynamic/flat_groups_filled": float(filled)})
    return out
