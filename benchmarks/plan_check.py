"""rl-plan's predictions against what this machine measures: a trainer rank's peak resident
memory (benchmarks/update_zero.py's workload, per model, ZeRO stage and rank count) and, for the
quickstart, the step split of a short rl-train run. Prints the table of docs/planning.md.

    .venv/bin/python benchmarks/plan_check.py                      # tiny-qwen2 and bench-100m
    .venv/bin/python benchmarks/plan_check.py --models tiny-qwen2 --rows 0,2,3 --ranks 2
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# update_zero.py's rows as config overrides, and its workload: per rank 16 prompts of 18-24
# tokens x 8 responses of 2-8 tokens in one micro-batch of 128, a KL reference, one pass
ROW_OVERRIDES = {"0": ["trainer.zero_stage=0"],
                 "0-recompute": ["trainer.zero_stage=0", "trainer.gradient_checkpointing=true"],
                 "2": ["trainer.zero_stage=2"],
                 "3": ["trainer.zero_stage=3"],
                 "3-whole": ["trainer.zero_stage=3", "trainer.zero3_whole_model_max=1000000000"],
                 "3-modules": ["trainer.zero_stage=3", "trainer.zero3_whole_model_max=0"]}
WORKLOAD = ["trainer.micro_batch_size=128", "rollout.n=8", "rollout.max_new_tokens=8",
            "algorithm.loss.kl_coef=0.001", "placement=disaggregated"]


def predicted_mib(model: str, row: str, ranks: int) -> float:
    from rl.config import load_config
    from rl.data.models import build_tiny_model
    from rl.plan.plan import Cluster, make_plan
    from rl.plan.report import model_shape
    from rl.plan.run import cached_cpu
    from rl.data.models import cache_root

    cfg = load_config(None, [f"model.path=builtin:{model}", f"ray.num_workers={ranks}",
                             f"rollout.prompts_per_step={16 * ranks}", *WORKLOAD,
                             "trainer.gradient_checkpointing=false", *ROW_OVERRIDES[row]])
    shape = model_shape(str(build_tiny_model(model)))
    plan = make_plan(cfg, shape, Cluster(cached_cpu(cache_root()), 1, 1), prompt_tokens=24)
    return plan.process_rss() / 2 ** 20


def measured(model: str, rows: str, ranks: int) -> dict[str, list[float]]:
    """{row: [peak MiB per rank]} from update_zero.py (fresh processes per row)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "update_zero.py"),
                          "--model", model, "--rows", rows, "--ranks", str(ranks),
                          "--steps", "2"], capture_output=True, text=True, check=True).stdout
    found = {}
    for m in re.finditer(r"ZeRO-(\S+) run 1: step [\d.]+ s, peak per rank ([\d, ]+) MiB", out):
        found[m.group(1)] = [float(x) for x in m.group(2).split(",")]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen2,bench-100m")
    ap.add_argument("--rows", default="0,2,3")
    ap.add_argument("--ranks", default="1,2")
    args = ap.parse_args()
    cpu = "AMX" if "amx_bf16" in Path("/proc/cpuinfo").read_text() else "no AMX"
    print(f"rl-plan against this machine ({os.cpu_count()} cores, {cpu}): a trainer rank's peak "
          f"resident memory, update_zero.py's workload")
    print("| model | ranks | ZeRO | measured MiB (per rank) | predicted MiB | predicted / measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        for ranks in map(int, args.ranks.split(",")):
            for row, peaks in measured(model, args.rows, ranks).items():
                p = predicted_mib(model, row, ranks)
                print(f"| {model} | {ranks} | {row} | {', '.join(f'{x:.0f}' for x in peaks)} | "
                      f"{p:.0f} | {p / max(peaks):.2f} |", flush=True)


if __name__ == "__main__":
    main()
