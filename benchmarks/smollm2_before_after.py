"""A real model on a real task: SmolLM2-135M on reasoning-gym's chain_sum, held-out accuracy
before and after GRPO, with its standard error.

    .venv/bin/python benchmarks/smollm2_before_after.py              # run the recipe, then report
    .venv/bin/python benchmarks/smollm2_before_after.py --recipe R   # another recipe
    .venv/bin/python benchmarks/smollm2_before_after.py --run DIR    # report a finished run

The first form runs `rl-train recipes/smollm2_chain_sum.yaml` (or R, e.g.
recipes/smollm2_tools.yaml) in a fresh process with an empty
cache (the GGUF model build and the task's rows are timed too; the run goes to
runs/smollm2_before_after/<recipe>/) and reports its wall time.
Printed: greedy accuracy on the held-out prompts before step 1 and after the last step, each
with its standard error sqrt(p(1-p)/n); the gain against twice the standard error of the
difference (sqrt(se_before^2 + se_after^2), as if the two were independent: conservative for the
same prompts); and the paired count of prompts that went wrong -> right and right -> wrong.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/smollm2_chain_sum.yaml"


def run_recipe(recipe: str, out: Path, cache: Path) -> tuple[Path, float]:
    exe = Path(sys.executable).with_name("rl-train")
    name = Path(recipe).stem
    t0 = time.perf_counter()
    subprocess.run([str(exe), recipe, f"run.output_dir={out}", f"run.name={name}"],
                   check=True, cwd=ROOT, env=dict(os.environ, RL_CACHE_DIR=str(cache)),
                   stdout=sys.stderr)
    return out / name, time.perf_counter() - t0


def greedy_correct(path: Path) -> dict[str, bool]:
    """prompt -> whether its greedy response was correct, from an eval/step_N.jsonl file."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["prompt"]: r["reward"] >= 1.0 for r in rows}


def report(run_dir: Path, wall: float | None) -> dict:
    files = sorted((run_dir / "eval").glob("step_*.jsonl"), key=lambda p: int(p.stem[5:]))
    if len(files) < 2:
        raise SystemExit(f"{run_dir}/eval has {len(files)} evaluation file(s); the run must "
                         f"have finished (an evaluation before step 1 and after the last)")
    before, after = greedy_correct(files[0]), greedy_correct(files[-1])
    if before.keys() != after.keys():
        raise SystemExit(f"{files[0]} and {files[-1]} hold different prompts")
    n = len(before)
    p0, p1 = sum(before.values()) / n, sum(after.values()) / n
    se0, se1 = math.sqrt(p0 * (1 - p0) / n), math.sqrt(p1 * (1 - p1) / n)
    se_diff = math.sqrt(se0 ** 2 + se1 ** 2)
    fixed = sum(after[p] and not before[p] for p in before)
    broken = sum(before[p] and not after[p] for p in before)
    out = {"prompts": n, "before": p0, "se_before": se0, "after": p1, "se_after": se1,
           "gain": p1 - p0, "two_se_of_gain": 2 * se_diff, "wrong_to_right": fixed,
           "right_to_wrong": broken, "last_step": int(files[-1].stem[5:]), "wall_s": wall}
    print(f"held-out prompts: {n} (steps {files[0].stem[5:]} and {files[-1].stem[5:]})")
    print(f"greedy accuracy before: {p0:.3f} +- {se0:.3f}   after: {p1:.3f} +- {se1:.3f}")
    print(f"gain {p1 - p0:+.3f}, twice its standard error {2 * se_diff:.3f}: "
          f"{'above' if p1 - p0 > 2 * se_diff else 'NOT above'}")
    print(f"paired: {fixed} prompts wrong -> right, {broken} right -> wrong")
    if wall is not None:
        print(f"wall time (rl-train from an empty cache): {wall:.0f} s ({wall / 60:.1f} min)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="report this finished run directory instead")
    ap.add_argument("--wall", type=float, help="with --run: its measured wall time, seconds")
    ap.add_argument("--recipe", default=RECIPE, help=f"the recipe to run (default {RECIPE})")
    args = ap.parse_args()
    if args.run:
        report(args.run, args.wall)
        return
    out = ROOT / "runs" / "smollm2_before_after"
    with tempfile.TemporaryDirectory(prefix="smollm2_cache_") as cache:
        run_dir, wall = run_recipe(args.recipe, out, Path(cache))
    figures = report(run_dir, wall)
    (run_dir / "before_after.json").write_text(json.dumps(figures, indent=1))
    print(f"the run: {run_dir}")


if __name__ == "__main__":
    main()
