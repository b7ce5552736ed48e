"""Held-out evaluation: how well the policy answers prompts that RL and the warm-up never saw.

Each evaluation decodes every held-out prompt greedily once and, with trainer.eval_k = k > 0,
samples it k times at the rollout temperature, on the rollout engines, and scores the responses
with the run's reward. A response is correct when its reward reaches trainer.eval_threshold.
- eval/greedy_accuracy: fraction of prompts whose greedy response is correct;
- eval/greedy_reward: mean reward of the greedy responses;
- eval/pass@k: fraction of prompts with at least one correct response among the k samples;
- eval/sample_accuracy: fraction of the k samples that are correct (the sampled accuracy).
The sampling seeds are fixed, so two evaluations of the same weights (a run's step-0 evaluation
and `rl-eval` of its base model) give the same numbers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from rl.run.collect import generate_spread
from rl.run.step_metrics import conversation

EVAL_SEED = 1_000_000_007  # apart from the rollout's seeds, which grow from run.seed and step


class Evaluator:
    def __init__(self, prompts, scorer, k: int, threshold: float, out_dir: Path | None = None,
                 decode=None):
        """prompts: an rl.data.prompts.PromptSet of the held-out rows; scorer: an
        rl.run.rewarding.RewardScorer; out_dir: where each evaluation's responses go
        (step_<N>.jsonl), or None; decode: multi-turn, the tokenizer's decode, to write each
        greedy trajectory's whole conversation."""
        self.prompts, self.scorer = prompts, scorer
        self.k, self.threshold, self.out_dir, self.decode = k, threshold, out_dir, decode

    def _generate(self, engines: list, version: int | None, greedy: bool) -> list[list[dict]]:
        """Completions per held-out prompt, in order, the prompts spread over the engines."""
        n = 1 if greedy else self.k
        indices = list(range(len(self.prompts.prompt_ids)))
        spread = generate_spread(engines, self.prompts, indices,
                                 [EVAL_SEED + i * n for i in indices], n=n, version=version,
                                 greedy=greedy)
        return [group for _, result in spread for group in result["groups"]]

    def _score(self, groups: list[list[dict]]) -> list[list[float]]:
        rows = [self.prompts.rows[i] for i, g in enumerate(groups) for _ in g]
        # multi-turn: an env's own reward, where it gave one, is the trajectory's (as in training)
        rewards, _ = self.scorer.score(rows, [c["text"] for g in groups for c in g],
                                       [c.get("env_reward") for g in groups for c in g])
        out, at = [], 0
        for g in groups:
            out.append(rewards[at:at + len(g)])
            at += len(g)
        return out

    def run(self, engines: list, version: int | None, step: int) -> dict:
        """Evaluate the engines' current weights (which must be `version`); eval/* metrics."""
        t0 = time.perf_counter()
        greedy = self._generate(engines, version, greedy=True)
        greedy_rewards = [r[0] for r in self._score(greedy)]
        ok = [r >= self.threshold for r in greedy_rewards]
        num = len(greedy)
        metrics = {"eval/greedy_accuracy": sum(ok) / num,
                   "eval/greedy_reward": sum(greedy_rewards) / num,
                   "eval/num_prompts": float(num)}
        sampled = sampled_rewards = None
        if self.k:
            sampled = self._generate(engines, version, greedy=False)
            sampled_rewards = self._score(sampled)
            correct = [[r >= self.threshold for r in rs] for rs in sampled_rewards]
            metrics[f"eval/pass@{self.k}"] = sum(any(c) for c in correct) / num
            metrics["eval/sample_accuracy"] = sum(sum(c) for c in correct) / (num * self.k)
        metrics["time/eval"] = time.perf_counter() - t0
        if self.out_dir is not None:
            self._write(step, greedy, greedy_rewards, sampled, sampled_rewards)
        return metrics

    def _write(self, step, greedy, greedy_rewards, sampled, sampled_rewards) -> None:
        """One line per held-out prompt: the greedy response and its reward, and how many of
        the k samples were correct."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (g, r) in enumerate(zip(greedy, greedy_rewards)):
            line = {"prompt": self.prompts.texts[i], "greedy": g[0]["text"], "reward": r}
            if self.decode is not None and "loss_mask" in g[0]:
                line["conversation"] = conversation(g[0]["token_ids"], g[0]["loss_mask"],
                                                    self.decode)
            if sampled is not None:
                line["correct_of_k"] = sum(x >= self.threshold for x in sampled_rewards[i])
                line["k"] = self.k
            lines.append(json.dumps(line))
        (self.out_dir / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")


def console_line(step: int, metrics: dict) -> str:
    """'eval after step 20: greedy accuracy 0.63 | pass@8 0.91 | ...' for the console."""
    parts = [f"greedy accuracy {metrics['eval/greedy_accuracy']:.3f}",
             f"greedy reward {metrics['eval/greedy_reward']:.3f}"]
    parts += [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items()
              if k.startswith("eval/pass@") or k == "eval/sample_accuracy"]
    where = "before step 1" if step == 0 else f"after step {step}"
    return (f"eval {where} ({int(metrics['eval/num_prompts'])} held-out prompts, "
            f"{metrics['time/eval']:.1f}s): " + " | ".join(parts))


def evaluate_model(cfg, rows, model_dir: str, out_dir: Path | None = None) -> dict:
    """rl-eval: start the recipe's engines on `model_dir` (no trainer), evaluate the held-out
    rows (rows: rl.data.prompts.Rows) once as a run's step-0 evaluation does; eval/* metrics."""
    from transformers import AutoTokenizer

    from envs.registry import env_factory
    from rl.config import ConfigError
    from rl.data.prompts import PromptSet
    from rl.errors import prompt_error
    from rl.run.cluster import start_ray
    from rl.run.placement import EnginesOnly
    from rl.run.rewarding import RewardScorer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        prompts = PromptSet(rows.held_out, tokenizer, cfg.data, cfg.run.seed, cfg.rollout,
                            env_factory(cfg.env))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(prompt_error(e, cfg)) from None
    start_ray(cfg)
    scorer = RewardScorer(cfg.reward, cfg.data.prompt_key)
    placement = None
    try:
        placement = EnginesOnly(cfg)  # the run's engines, without its trainers
        placement.init_rollout(str(Path(model_dir).resolve()), 0)
        metrics = Evaluator(prompts, scorer, cfg.trainer.eval_k, cfg.trainer.eval_threshold,
                            out_dir, tokenizer.decode).run(placement.engines, 0, 0)
        print(console_line(0, metrics), flush=True)
    finally:
        scorer.close()
        if placement is not None:
            placement.stop()
    if out_dir is not None:
        (out_dir / "eval.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    return metrics
