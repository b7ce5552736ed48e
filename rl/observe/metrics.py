"""What a run leaves for people: metrics.jsonl (and TensorBoard / W&B), a console line or bar
per step, rollouts, a plot."""
from __future__ import annotations

import json
import math
from pathlib import Path

from rl.observe.progress import Progress

# the step's phases, as the plot stacks them
PHASES = ("time/rollout", "time/reward", "time/update", "time/sync")


def eval_curves(history: list[dict]) -> list[str]:
    """The eval/ metrics drawn in metrics.png: the accuracies and rewards (0-1), not the count of
    held-out prompts, which would flatten them."""
    return sorted({k for m in history for k in m
                   if k.startswith("eval/") and k != "eval/num_prompts"})


def keep_lines(path: Path, last_step: int) -> list[dict]:
    """Drop the lines of a jsonl log written after step `last_step` (by a run that died after
    its checkpoint); returns the lines kept."""
    if not path.exists():
        return []

    def step_of(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):  # torn by the crash: dropped
            return float("inf")

    kept = [line for line in path.read_text().splitlines()
            if line.strip() and step_of(line) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return [json.loads(line) for line in kept]


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int, loggers: list | None = None,
                 stream=None, resume: tuple[int, dict] | None = None):
        """resume: (the checkpoint's step, its metrics line): the logs keep steps up to it
        (lines a run wrote after its last checkpoint go), and get its line back if the run died
        between saving the checkpoint and logging the line."""
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self.history: list[dict] = []
        self.loggers = loggers or []
        self.progress = Progress(total_steps, "RL steps", stream=stream)
        if resume is not None:
            step, line = resume
            self.history = keep_lines(self.metrics_path, step)
            keep_lines(self.rollouts_path, step)
            for logger in self.loggers:  # what a killed process's sinks never wrote
                logger.catch_up(self.history)
            if self.progress.bar is not None:
                self.progress.bar.update(len(self.step_lines()))
            if not self.history or self.history[-1]["step"] < step:
                self.log_step(line)

    def log_step(self, metrics: dict) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        self.history.append(clean)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        for logger in self.loggers:
            logger.log(clean, clean["step"])
        if "reward/mean" not in clean:  # the held-out evaluation before step 1: no step ran
            return
        self.progress.update(clean["step"], self.console_line(clean),
                             {"reward": f"{clean['reward/mean']:.3f}",
                              "s/step": f"{clean['time/step']:.2f}",
                              "eta": f"{self.eta_seconds(clean) / 60:.1f} min"})

    def close(self) -> None:
        self.progress.close()
        for logger in self.loggers:
            logger.close()
        self.loggers = []

    def step_lines(self) -> list[dict]:
        """The RL steps' lines (not the held-out evaluation of the base model, step 0)."""
        return [m for m in self.history if "reward/mean" in m]

    def eta_seconds(self, m: dict) -> float:
        # the first step pays engine warm-up: estimate from the later ones when there are some
        steps = [h["time/step"] for h in self.history if "time/step" in h]
        recent = steps[1:][-20:] or [m["time/step"]]
        return sum(recent) / len(recent) * (self.total_steps - m["step"])

    def console_line(self, m: dict) -> str:
        step = m["step"]
        eta = self.eta_seconds(m)
        parts = [f"step {step}/{self.total_steps}",
                 f"reward {m['reward/mean']:.3f}±{m['reward/std']:.2f}",
                 f"loss {m.get('loss/policy', math.nan):+.4f}"]
        if "kl/mean" in m:
            parts.append(f"kl {m['kl/mean']:.4f}")
        parts += [f"len {m.get('response/length_mean', 0):.1f}",
                  f"sync Δ {m['sync/logprob_max_abs_diff']:.1e}",
                  f"{m['time/step']:.1f}s (roll {m['time/rollout']:.1f} upd {m['time/update']:.1f}"
                  f" sync {m['time/sync']:.1f})",
                  f"eta {eta / 60:.1f} min"]
        return " | ".join(parts)

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        with self.rollouts_path.open("a") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}) + "\n")

    def plot(self) -> Path | None:
        """metrics.png: reward (raw and smoothed), held-out evaluation when there is one, KL,
        response length and the step time split into its phases, against step."""
        history = self.step_lines()
        if not history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        steps = [m["step"] for m in history]

        def series(key):
            return [m.get(key, math.nan) for m in history]

        panels = [("reward", self._plot_reward)]
        evals = eval_curves(self.history)
        if evals:
            size = [m["eval/num_prompts"] for m in self.history if "eval/num_prompts" in m]
            title = "held-out evaluation" + (f" ({size[0]:.0f} prompts)" if size else "")
            panels.append((title, lambda ax: [
                ax.plot(*zip(*[(m["step"], m[k]) for m in self.history if k in m]), marker="o",
                        label=k.removeprefix("eval/")) for k in evals]))
        for key, title in (("kl/mean", "KL to the reference"),
                           ("response/length_mean", "response length (tokens)")):
            if key in history[0]:
                panels.append((title, lambda ax, key=key: ax.plot(steps, series(key))))
        panels.append(("step time (s)", lambda ax: ax.stackplot(
            steps, *[series(k) for k in PHASES],
            labels=[k.removeprefix("time/") for k in PHASES], alpha=0.8)))
        self.plot_panels = [title for title, _ in panels]
        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
        for ax, (title, draw) in zip(axes.flat, panels):
            draw(ax)
            ax.set_title(title, fontsize=11)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="best")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(self.run_dir.name, fontsize=12)
        fig.tight_layout()
        out = self.run_dir / "metrics.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out

    def _plot_reward(self, ax) -> None:
        history = self.step_lines()
        steps = [m["step"] for m in history]
        raw = [m["reward/mean"] for m in history]
        ax.plot(steps, raw, color="tab:blue", alpha=0.3, linewidth=1, label="per step")
        ax.plot(steps, smooth(raw), color="tab:blue", linewidth=2, label="smoothed")


def smooth(values: list[float], window_fraction: float = 0.1) -> list[float]:
    """Exponential moving average with a span of ~10% of the run (TensorBoard-style
    smoothing, debiased so the first points are not pulled towards zero)."""
    span = max(1.0, window_fraction * len(values))
    alpha = 2.0 / (span + 1.0)
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out
