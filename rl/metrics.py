"""What a run leaves for people: metrics.jsonl, a console line per step, rollouts, a plot."""
from __future__ import annotations

import json
import math
from pathlib import Path


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int):
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self.history: list[dict] = []

    def log_step(self, metrics: dict) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        self.history.append(clean)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        print(self.console_line(clean), flush=True)

    def console_line(self, m: dict) -> str:
        step = m["step"]
        # the first step pays engine warm-up: estimate from the later ones when there are some
        recent = [h["time/step"] for h in self.history[1:][-20:]] or [m["time/step"]]
        eta = sum(recent) / len(recent) * (self.total_steps - step)
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
        """metrics.png: reward, loss, KL and response length against step."""
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = [k for k in ("reward/mean", "loss/policy", "kl/mean", "response/length_mean",
                            "sync/logprob_max_abs_diff", "time/step") if k in self.history[0]]
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8))
        steps = [m["step"] for m in self.history]
        for ax, key in zip(axes, keys):
            ax.plot(steps, [m.get(key, math.nan) for m in self.history])
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
        fig.tight_layout()
        out = self.run_dir / "metrics.png"
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return out
