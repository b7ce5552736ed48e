"""The quickstart on several seeds, as a new user runs it: its figures and its curves in one picture.

    .venv/bin/python benchmarks/quickstart_seeds.py                    # seeds 0,1,2, fresh caches
    .venv/bin/python benchmarks/quickstart_seeds.py --runs DIR DIR DIR  # figures of finished runs
    .venv/bin/python benchmarks/quickstart_seeds.py --recipe recipes/quickstart_lora.yaml
        # another quickstart recipe (its picture: docs/<recipe>_seeds.png)
    .venv/bin/python benchmarks/quickstart_seeds.py --against rollout.tensor_parallel_size=2
        # each seed as shipped, then again with the overrides on the same warm-up (its cache
        # kept): both tables, and the difference of their means of steps 101-300

Each seed runs `rl-train recipes/quickstart.yaml run.seed=S` in a fresh process with an empty
cache (so the model build and the warm-up are timed too), one seed after the other. Printed per
seed: held-out greedy accuracy before step 1 and after the last, the last-10-step reward/mean,
the mean reward/mean of steps 101-300, the median step time, the wall time; written: docs/quickstart_seeds.png (reward/mean, smoothed, and held-out greedy
accuracy against step, one colour per seed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/quickstart.yaml"


def run_seed(seed: int, out: Path, overrides: tuple[str, ...] = (), tag: str = "",
             recipe: str = RECIPE) -> tuple[Path, float]:
    """The quickstart on `seed`; from an empty cache unless `overrides` (a second run of the
    seed, on the first one's warm-up)."""
    cache, run_dir = out / f"cache_s{seed}", out / f"seed{seed}{tag}"
    if not overrides:
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    # an earlier run's directory of that name would make rl-train write to seed0-2 and the
    # figures come from the old run (another recipe's, say)
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    exe = Path(sys.executable).with_name("rl-train")
    t0 = time.perf_counter()
    subprocess.run([str(exe), recipe, f"run.seed={seed}",
                    f"run.output_dir={out}", f"run.name=seed{seed}{tag}", *overrides], check=True,
                   cwd=ROOT, env=dict(os.environ, RL_CACHE_DIR=str(cache)), stdout=sys.stderr)
    return run_dir, time.perf_counter() - t0


def figures(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward/mean" in m]
    evals = [m for m in lines if "eval/greedy_accuracy" in m]
    return {"seed": _seed(run_dir), "steps": len(steps),
            "eval_first": evals[0]["eval/greedy_accuracy"],
            "eval_last": evals[-1]["eval/greedy_accuracy"],
            "reward_last10": sum(m["reward/mean"] for m in steps[-10:]) / 10,
            "reward_101_300": (sum(m["reward/mean"] for m in steps[100:300]) / 200
                               if len(steps) >= 300 else float("nan")),
            "seconds_per_step": sorted(m["time/step"] for m in steps)[len(steps) // 2],
            "reward_step1": steps[0]["reward/mean"], "lines": lines}


def _seed(run_dir: Path) -> int:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["seed"]


def plot(results: list[dict], picture: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT))
    from rl.observe.metrics import smooth

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r, color in zip(results, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        steps = [m for m in r["lines"] if "reward/mean" in m]
        left.plot([m["step"] for m in steps], smooth([m["reward/mean"] for m in steps]),
                  color=color, label=f"seed {r['seed']}")
        evals = [m for m in r["lines"] if "eval/greedy_accuracy" in m]
        right.plot([m["step"] for m in evals], [m["eval/greedy_accuracy"] for m in evals],
                   color=color, marker="o", markersize=3, label=f"seed {r['seed']}")
    left.set_title("reward/mean (training prompts, sampled; smoothed)")
    right.set_title("held-out greedy accuracy")
    for ax in (left, right):
        ax.axhline(0.8, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    picture.parent.mkdir(exist_ok=True)
    fig.savefig(picture, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs", nargs="*", help="finished run directories: only figures and plot")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "quickstart_seeds"))
    p.add_argument("--against", nargs="+", metavar="KEY=VALUE",
                   help="run each seed again with these overrides, on the same warm-up")
    p.add_argument("--recipe", default=RECIPE, help="the quickstart recipe to run")
    args = p.parse_args()
    picture = ROOT / "docs" / f"{Path(args.recipe).stem}_seeds.png"
    walls: dict = {}
    if args.runs:
        runs, again = [Path(r) for r in args.runs], []
    else:
        runs, again = [], []
        for seed in map(int, args.seeds.split(",")):
            run_dir, walls[seed] = run_seed(seed, Path(args.out), recipe=args.recipe)
            runs.append(run_dir)
            if args.against:
                run_dir, walls[seed, "against"] = run_seed(seed, Path(args.out),
                                                           tuple(args.against), "-against",
                                                           args.recipe)
                again.append(run_dir)
    results = [figures(r) for r in runs]
    table(results, walls)
    if again:
        print(f"\nthe same seeds with {' '.join(args.against)}:")
        others = [figures(r) for r in again]
        table(others, {k[0]: v for k, v in walls.items() if isinstance(k, tuple)})
        mean = sum(r["reward_101_300"] for r in results) / len(results)
        other = sum(r["reward_101_300"] for r in others) / len(others)
        print(f"\nmean of steps 101-300 over the seeds: {mean:.3f} as shipped, {other:.3f} with "
              f"{' '.join(args.against)} (difference {other - mean:+.3f})")
        return
    plot(results, picture)
    print(f"\nwrote {picture}")


def table(results: list[dict], walls: dict) -> None:
    print("| seed | held-out greedy acc., step 0 | at the end | reward/mean step 1 | "
          "last 10 steps | mean of steps 101-300 | s/step (median) | wall time |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        wall = f"{walls[r['seed']]:.0f} s" if r["seed"] in walls else "-"
        print(f"| {r['seed']} | {r['eval_first']:.3f} | {r['eval_last']:.3f} | "
              f"{r['reward_step1']:.3f} | {r['reward_last10']:.3f} | {r['reward_101_300']:.3f} | "
              f"{r['seconds_per_step']:.3f} | {wall} |")


if __name__ == "__main__":
    main()
