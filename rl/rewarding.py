"""Scoring samples with the configured reward; a failing sample is counted, never fatal."""
from __future__ import annotations

import math
import traceback

from rewards.registry import resolve
from rl.config import RewardConfig


class RewardScorer:
    def __init__(self, cfg: RewardConfig, prompt_key: str):
        self.cfg = cfg
        self.fn = resolve(cfg.name)
        self.prompt_key = prompt_key
        self._printed_traceback = False

    def score(self, rows: list[dict], completions: list[str]) -> tuple[list[float], dict]:
        """Rewards in sample order, plus reward/mean, reward/std and reward/errors."""
        rewards, errors = [], 0
        for row, completion in zip(rows, completions):
            extra = {k: v for k, v in row.items() if k not in (self.prompt_key, "completion")}
            try:
                value = self.fn(prompt=row[self.prompt_key], completion=completion, **extra)
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value):
                    raise TypeError(f"reward '{self.cfg.name}' returned {value!r}; "
                                    f"a reward must be a finite int or float")
                rewards.append(float(value))
            except Exception:  # a bad sample is counted and reported; the run goes on
                errors += 1
                rewards.append(self.cfg.fallback)
                if not self._printed_traceback:
                    self._printed_traceback = True
                    print(f"reward '{self.cfg.name}' failed on a sample (given "
                          f"reward.fallback={self.cfg.fallback}); first traceback, later "
                          f"failures only counted in reward/errors:\n{traceback.format_exc()}",
                          flush=True)
        n = max(len(rewards), 1)
        mean = sum(rewards) / n
        std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
        return rewards, {"reward/mean": mean, "reward/std": std, "reward/errors": float(errors)}
