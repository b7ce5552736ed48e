"""Scoring samples with the configured reward terms, in worker processes with timeouts.

A term that raises, hangs past reward.timeout_s, or returns a non-number/NaN gives that sample
reward.fallback for the term and is counted (reward/errors, reward/timeouts); the first
traceback is printed once; the run goes on.
"""
from __future__ import annotations

import math
import re

from rewards.pool import ERROR, OK, TIMEOUT, RewardPool
from rewards.registry import is_batched, resolve, start_check_of
from rl.config import ConfigError
from rl.errors import last_line
from rl.schema import RewardConfig, RewardTerm

REWARD_MODEL = "reward_model"


def term_alias(term: RewardTerm) -> str:
    if term.alias:
        return term.alias
    return re.sub(r"[^A-Za-z0-9_.-]", "_", term.name.rpartition(":")[2] or term.name)


def check_reward_terms(cfg: RewardConfig, rows: list[dict]) -> None:
    """Each term's start check on every dataset row (e.g. code_exec's test cases and sandbox),
    and every name resolved: run before Ray and the engines start, so a bad recipe or data set
    fails in seconds. A refusal is a ConfigError naming the term."""
    for term in cfg.functions:
        if term.name == REWARD_MODEL:
            continue
        try:
            check = start_check_of(resolve(term.name))
        except ValueError as e:  # an unknown name: the message lists the known ones
            raise ConfigError(str(e)) from None
        try:
            if check is not None:
                check(rows, dict(term.args))
        except ValueError as e:  # a refusal, one line (rewards.registry.start_check)
            raise ConfigError(f"reward '{term.name}': {e}") from None


def load_rows(cfg) -> tuple[list[dict], list[dict] | None]:
    """The training file's rows and the held-out file's (data.eval_path; None without one)."""
    from pathlib import Path

    from rl.data.prompts import resolve_rows
    from rl.data.tasks import read_rows

    rows = resolve_rows(cfg.data, cfg.run.seed)
    if not cfg.data.eval_path:
        return rows, None
    if not Path(cfg.data.eval_path).exists():
        raise FileNotFoundError(f"data.eval_path '{cfg.data.eval_path}' does not exist; give "
                                f"the held-out file or use data.eval_fraction")
    return rows, read_rows(cfg.data.eval_path)


def checked_rows(cfg, loaded: tuple[list[dict], list[dict] | None] | None = None):
    """The data set (a Config's data section) as rl.data.prompts.Rows, training and held-out rows
    through every reward term's start check: before torch, Ray or an engine starts, so a bad
    data set fails in seconds. loaded: what load_rows(cfg) returned, if the caller has it."""
    from rl.data.prompts import split_rows

    rows, held_out = loaded if loaded is not None else load_rows(cfg)
    split = split_rows(rows, cfg.data, held_out)
    check_reward_terms(cfg.reward, split.train + split.held_out)
    return split


class RewardScorer:
    def __init__(self, cfg: RewardConfig, prompt_key: str):
        self.cfg, self.prompt_key = cfg, prompt_key
        if not cfg.functions:
            raise ValueError("reward.functions is empty; give at least one reward term")
        self.aliases = [term_alias(t) for t in cfg.functions]
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError(f"reward terms need distinct names; got {self.aliases}: set alias")
        self.fn_terms = [i for i, t in enumerate(cfg.functions) if t.name != REWARD_MODEL]
        self.batched = {i: is_batched(resolve(cfg.functions[i].name)) for i in self.fn_terms}
        self.models = {i: self._start_reward_model(t) for i, t in enumerate(cfg.functions)
                       if t.name == REWARD_MODEL}
        for i, actor in self.models.items():  # all load at once; each is waited for here
            self._wait_loaded(cfg.functions[i], actor)
        self.pool = RewardPool([cfg.functions[i].name for i in self.fn_terms], cfg.num_workers,
                               cfg.timeout_s) if self.fn_terms else None
        self._printed = False

    @staticmethod
    def _start_reward_model(term: RewardTerm):
        """The reward model in its own Ray actor (the controller's Ray session)."""
        import ray

        from rewards.reward_model import RewardModelScorer

        if "path" not in term.args:
            raise ValueError("reward term 'reward_model' needs args.path: a local directory of a "
                             "transformers sequence-classification model")
        return ray.remote(num_cpus=0)(RewardModelScorer).remote(**term.args)

    @staticmethod
    def _wait_loaded(term: RewardTerm, actor) -> None:
        """Returns once the model has loaded: reward.timeout_s bounds scoring, not the actor's
        start-up, and a model that cannot load stops the run here instead of giving every
        sample the fallback."""
        import ray

        try:
            ray.get(actor.ready.remote())
        except ray.exceptions.RayActorError as e:
            raise ValueError(f"reward term 'reward_model' (args.path={term.args['path']!r}) "
                             f"did not load: {last_line(getattr(e, 'cause', None) or e)}"
                             ) from None

    def _calls(self, rows: list[dict], completions: list[str]):
        """(pool calls, [(term, sample indices)] they cover)."""
        calls, cover = [], []
        extras = [{k: v for k, v in r.items() if k not in (self.prompt_key, "completion")}
                  for r in rows]
        prompts = [r[self.prompt_key] for r in rows]
        for slot, i in enumerate(self.fn_terms):
            args = self.cfg.functions[i].args
            if self.batched[i]:
                for start in range(0, len(rows), self.cfg.batch_size):
                    idx = list(range(start, min(start + self.cfg.batch_size, len(rows))))
                    columns = {k: [extras[j].get(k) for j in idx] for k in extras[idx[0]]}
                    calls.append((slot, {"prompts": [prompts[j] for j in idx],
                                         "completions": [completions[j] for j in idx],
                                         **columns, **args}))
                    cover.append((i, idx, True))
            else:
                for j in range(len(rows)):
                    calls.append((slot, {"prompt": prompts[j], "completion": completions[j],
                                         **extras[j], **args}))
                    cover.append((i, [j], False))
        return calls, cover

    def _report(self, name: str, detail: str) -> None:
        if not self._printed:
            self._printed = True
            print(f"reward '{name}' failed on a sample (it gets reward.fallback="
                  f"{self.cfg.fallback}); first failure, later ones are only counted in "
                  f"reward/errors and reward/timeouts:\n{detail}", flush=True)

    def score(self, rows: list[dict], completions: list[str],
              given: list[float | None] | None = None) -> tuple[list[float], dict]:
        """Total rewards in sample order, plus per-term means and failure counts. given:
        multi-turn, the reward each trajectory's environment gave (None where it gave none):
        it is that sample's total."""
        n, fallback = len(rows), self.cfg.fallback
        values = {i: [fallback] * n for i in range(len(self.cfg.functions))}
        errors = timeouts = 0
        calls, cover = self._calls(rows, completions)
        results = self.pool.run(calls) if calls else []
        futures = {i: actor.score.remote([str(r[self.prompt_key]) for r in rows], completions)
                   for i, actor in self.models.items()}
        outcomes = [(i, idx, many, status, value)
                    for (i, idx, many), (status, value) in zip(cover, results)]
        for i, future in futures.items():
            import ray

            try:
                outcomes.append((i, list(range(n)), True, OK,
                                 ray.get(future, timeout=self.cfg.timeout_s)))
            except ray.exceptions.GetTimeoutError:
                outcomes.append((i, list(range(n)), True, TIMEOUT, None))
            except ray.exceptions.RayError as e:
                outcomes.append((i, list(range(n)), True, ERROR, str(e)))
        for i, idx, many, status, value in outcomes:
            name = self.cfg.functions[i].name
            if status == TIMEOUT:
                timeouts += len(idx)
                self._report(name, f"timed out after reward.timeout_s={self.cfg.timeout_s}")
                continue
            if status == ERROR:
                errors += len(idx)
                self._report(name, value)
                continue
            got = value if many else [value]
            if not isinstance(got, (list, tuple)) or len(got) != len(idx):
                errors += len(idx)
                self._report(name, f"a batched reward must return {len(idx)} values, got {got!r}")
                continue
            for j, v in zip(idx, got):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    errors += 1
                    self._report(name, f"returned {v!r}; a reward must be a finite int or float")
                else:
                    values[i][j] = float(v)
        totals = [sum(t.weight * values[i][j] for i, t in enumerate(self.cfg.functions))
                  for j in range(n)]
        if given is not None:
            totals = [t if g is None else g for t, g in zip(totals, given)]
        metrics = {f"reward/{a}/mean": sum(values[i]) / max(n, 1)
                   for i, a in enumerate(self.aliases)}
        metrics.update({"reward/errors": float(errors), "reward/timeouts": float(timeouts)})
        return totals, metrics

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        import sys

        if self.models and "ray" in sys.modules:
            import ray

            for actor in self.models.values():
                ray.kill(actor)
