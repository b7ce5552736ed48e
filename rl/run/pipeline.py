"""The asynchronous pipeline modes: a rollout producer that keeps every engine busy, and a
version-tagged buffer the trainer takes its batches from.

Staleness (the README defines it once): a sample's version is the policy version of its *first*
generated token; an update that starts from policy version u may only use samples with
u - version <= max_staleness.

The producer keeps the bound by waiting, not by throwing work away: it hands a batch of
prompts_per_step groups to the engines only while that batch would still be trained within the
bound. With S groups handed out and not yet trained, the next one is trained by the update that
starts from version u_next + S // prompts_per_step (u_next: the next update's starting version),
and its first token comes from the engines' current version p or a later one; so it is handed out
only when u_next + S // prompts_per_step - p <= max_staleness. `take` checks every group again and
drops (and counts, `pipeline/dropped_stale`) any that a slow engine let fall behind: in
`fully_async` a group can be overtaken by later ones.

- one_step: max_staleness 1; the trainer takes each batch whole, in the order handed out (the
  classic one-step-off pipeline: step k + 1's batch is generated during step k's update).
- fully_async: the trainer takes the prompts_per_step finished groups of the oldest versions,
  whichever batch they came from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from rl.algo.batch import Sample
from rl.run.collect import Collected, reward_summary


@dataclass
class Group:
    key: tuple[int, int]  # (batch handed out, group within it)
    samples: list[Sample]
    version: int  # the oldest first-token version of its samples


class RolloutProducer:
    """Hands prompt batches to the streaming engines and buffers what comes back. It is given
    what it uses (the run's config, its prompts, the engines, the scoring function) and is told
    the policy versions it works against in each call."""

    def __init__(self, cfg, prompts, engines: list, score):
        """score(samples) -> reward metrics: rewards each sample in place (Controller.score)."""
        self.cfg, self.prompts, self.engines, self.score = cfg, prompts, engines, score
        self.want = cfg.rollout.prompts_per_step
        self.n = cfg.rollout.n
        self.in_order = cfg.pipeline.mode == "one_step"
        self.max_staleness = 1 if self.in_order else cfg.pipeline.max_staleness
        self.batches = 0  # batches handed out
        self.in_flight: dict[tuple[int, int], int] = {}  # group key -> engine index
        self.buffer: list[Group] = []  # finished, not yet trained
        self.collects: dict = {}  # outstanding collect future -> engine index
        self.dropped_stale = 0
        self.engine_times = {"idle": 0.0, "paused": 0.0, "interrupted": 0.0}
        self.stats: list[dict] = []

    @property
    def unconsumed(self) -> int:
        return len(self.in_flight) + len(self.buffer)

    def fill(self, next_update_version: int, engines_version: int) -> None:
        """Hand out batches while the newest would be trained within the bound (the engines
        generate `engines_version` now)."""
        p = engines_version
        while next_update_version + self.unconsumed // self.want - p <= self.max_staleness:
            self._hand_out()

    def _hand_out(self) -> None:
        b = self.batches
        self.batches += 1
        rows = self.prompts.next_batch(self.want)
        base = ((self.cfg.run.seed * 1_000_003 + b) * 64) * 100_000
        engines = self.engines
        load = [0] * len(engines)
        for e in self.in_flight.values():
            load[e] += 1
        per_engine: list[list[tuple[int, int]]] = [[] for _ in engines]  # (group, row)
        for g, r in enumerate(rows):
            e = min(range(len(engines)), key=lambda i: load[i])
            load[e] += 1
            self.in_flight[(b, g)] = e
            per_engine[e].append((g, r))
        import ray

        ray.get([engines[e].submit.remote(
            [(b, g, r) for g, r in part],
            **self.prompts.request([r for _, r in part], [base + g * self.n for g, _ in part]))
            for e, part in enumerate(per_engine) if part])

    def _poll(self, version: int) -> None:
        """Wait for at least one engine's finished groups; into the buffer they go."""
        import ray

        busy = {e for e in self.in_flight.values()}
        waiting = set(self.collects.values())
        for e in busy - waiting:
            self.collects[self.engines[e].collect.remote(5.0)] = e
        if not self.collects:
            raise RuntimeError("the rollout producer has nothing in flight and too little "
                               "buffered for a batch")
        ready, _ = ray.wait(list(self.collects), num_returns=1)
        arrived: list[Group] = []
        for future in ready:
            self.collects.pop(future)
            result = ray.get(future)
            self.stats.append(result["stats"])
            for k, v in result["times"].items():
                self.engine_times[k] += v
            for item in result["groups"]:
                b, g, r = item["key"]
                self.in_flight.pop((b, g))
                samples = [Sample.of(r, g, self.prompts.prompt_ids[r], x, version,
                                     token_versions=True)
                           for x in item["completions"]]
                arrived.append(Group((b, g), samples, min(s.policy_version for s in samples)))
        self.buffer += arrived

    def _ready(self) -> list[Group]:
        """The groups the next update may take, in the order it takes them."""
        if self.in_order:  # the oldest batch, whole (at staleness 1 none of it is ever stale)
            oldest = min([k[0] for k in self.in_flight] + [g.key[0] for g in self.buffer])
            batch = [g for g in self.buffer if g.key[0] == oldest]
            return sorted(batch, key=lambda g: g.key) if len(batch) == self.want else []
        return sorted(self.buffer, key=lambda g: (g.version, g.key))[:self.want]

    def take(self, version: int) -> Collected:
        """The batch of the update that starts from policy `version` (which the engines
        generate now): prompts_per_step groups within its bound (waiting for the engines as
        needed)."""
        u = version
        t0 = time.perf_counter()
        self.fill(u, version)
        while True:
            stale = [g for g in self.buffer if u - g.version > self.max_staleness]
            if stale:
                self.dropped_stale += len(stale)
                self.buffer = [g for g in self.buffer if g not in stale]
                self.fill(u, version)
            ready = self._ready()
            if len(ready) >= self.want:
                break
            self._poll(version)
        waited = time.perf_counter() - t0
        taken = ready[:self.want]
        keys = {g.key for g in taken}
        self.buffer = [g for g in self.buffer if g.key not in keys]
        for i, grp in enumerate(taken):  # groups of this batch: contiguous, numbered in order
            for s in grp.samples:
                s.group = i
        samples = [s for grp in taken for s in grp.samples]
        t1 = time.perf_counter()
        metrics = self.score(samples)  # the trained batch's rewards, as in lock-step
        reward_seconds = time.perf_counter() - t1
        metrics.update(self._metrics(samples))
        return Collected(samples, samples, metrics, waited, reward_seconds,
                         {"time/trainer_wait": waited})

    def _metrics(self, samples: list[Sample]) -> dict:
        metrics = reward_summary(samples, self.cfg.algorithm.overlong_buffer)
        spread = [max(s.token_versions) - min(s.token_versions) for s in samples
                  if s.token_versions]
        n = max(len(self.engines), 1)
        metrics.update({
            "pipeline/buffer_size": float(len(self.buffer)),
            "pipeline/in_flight": float(len(self.in_flight)),
            "pipeline/dropped_stale": float(self.dropped_stale),
            "time/rollout_wait": self.engine_times["idle"] / n,
            "time/rollout_paused": self.engine_times["paused"] / n,
            "rollout/interrupted_frac": sum(x > 0 for x in spread) / len(samples),
            "pipeline/interrupted_sequences": self.engine_times["interrupted"],
            "rollout/version_spread_max": float(max(spread, default=0)),
        })
        self.engine_times = dict.fromkeys(self.engine_times, 0.0)
        if self.stats:
            metrics.update({k: sum(s[k] for s in self.stats) / len(self.stats)
                            for k in self.stats[0]})
            self.stats = []
        return metrics

