"""rl-plan's predictions against what this machine measures: a trainer rank's peak resident
memory (benchmarks/update_zero.py's workload, per model, ZeRO stage and rank count), and a
step's split (rollout, update, sync) in short rl-train runs. Prints the tables of
docs/planning.md.

    .venv/bin/python benchmarks/plan_check.py                      # tiny-qwen2 and bench-100m
    .venv/bin/python benchmarks/plan_check.py --models tiny-qwen2 --rows 0,2,3 --ranks 2
    .venv/bin/python benchmarks/plan_check.py --split              # the step split

The split: the CPU's utilizations and fixed costs (rl.plan.hardware.CPU_UTILIZATION,
CPU_OVERHEADS) are fitted on three calibration runs (CALIBRATION: a tiny model on 1 worker and on
2 at ZeRO-3, where fixed costs dominate, and bench-100m, where compute does), then checked on
two others that the fit never saw (CHECKED: the quickstart's and benchmarks/vs_trl.py's smollm2
preset's work). Every run
generates exactly max_new_tokens per sample (rollout.min_new_tokens), the length the plan
assumes, and starts from its base model (no warm-up: a step's time does not depend on the
weights once the lengths are fixed).
"""
from __future__ import annotations

import argparse
import json
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


# rl-train runs for the step split: recipes/quickstart.yaml and these overrides
NO_WARMUP = ["warmup.sft_steps=0", "data.eval_fraction=0", "trainer.eval_every=0",
             "trainer.total_steps=6"]
CALIBRATION = {
    "tiny-qwen2, 1 worker, 8 x 4 x 16 tokens": [
        "ray.num_workers=1", "trainer.zero_stage=0", "rollout.prompts_per_step=8", "rollout.n=4",
        "rollout.max_new_tokens=16", "rollout.min_new_tokens=16", "trainer.micro_batch_size=32"],
    # the recipe's placement (2 colocated workers, ZeRO-3), another workload than the quickstart's
    "tiny-qwen2, 2 workers, ZeRO-3, 16 x 8 x 12 tokens": [
        "rollout.prompts_per_step=16", "rollout.n=8", "rollout.max_new_tokens=12",
        "rollout.min_new_tokens=12", "trainer.micro_batch_size=64"],
    "bench-100m, 1 worker, 4 x 4 x 16 tokens": [
        "model.path=builtin:bench-100m", "ray.num_workers=1", "trainer.zero_stage=0",
        "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16",
        "rollout.min_new_tokens=16", "trainer.micro_batch_size=16"],
}
CHECKED = {
    # the quickstart recipe's placement and work (2 colocated workers, ZeRO-3, 32 x 8 x 8)
    "quickstart": ["rollout.min_new_tokens=8"],
    # benchmarks/vs_trl.py's smollm2 preset (its recipe(), rl-train row, float32)
    "smollm2 preset": [
        "model.path=builtin:smollm2-135m", "data.max_operand=15", "ray.num_workers=1",
        "trainer.zero_stage=0", "rollout.prompts_per_step=4", "rollout.n=4",
        "rollout.max_new_tokens=64", "rollout.min_new_tokens=64", "trainer.lr=1e-6",
        "trainer.micro_batch_size=16", "trainer.bf16_mode=autocast"],
}
PARTS = ("rollout", "update", "sync")


def split_run(name: str, overrides: list[str], out: Path) -> dict:
    """One rl-train run: its measured split (medians of the steps after the first) and the
    plan's terms at unit utilization and without fixed costs, to fit them (rl.plan.timing)."""
    from statistics import median

    run = out / re.sub(r"\W+", "_", name)
    subprocess.run([sys.executable, "-m", "rl.cli", str(ROOT / "recipes" / "quickstart.yaml"),
                    *NO_WARMUP, *overrides, f"run.output_dir={run}", "run.name=split"],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    lines = [json.loads(x) for x in (run / "split" / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in lines if m.get("step", 0) > 1 and "time/update" in m]
    plan = json.loads((run / "split" / "plan.json").read_text())
    t, hw = plan["time"], plan["hardware"]
    roll, upd = t["rollout"], t["update"]
    steps = roll["decode_steps"]
    bound_u = hw["decode_utilization" if roll["bound"] == "memory" else "prefill_utilization"]
    return {"measured": {k: median(m[f"time/{k}"] for m in timed) for k in PARTS},
            "planned": {k: timed[-1][f"plan/time_{k}"] for k in PARTS},
            "rollout": [roll["prefill"] * hw["prefill_utilization"]
                        + steps * (roll["decode_step"] - roll["decode_step_fixed"]) * bound_u,
                        steps, steps * roll["batch"]],
            "update": [upd["compute_seconds"] * hw["train_utilization"], upd["layer_passes"],
                       upd["zero3_layer_passes"]],
            "sync": [(t["sync"]["seconds"] - hw["sync_overhead"]) * hw["sync_utilization"], 1.0]}


def fit(runs: list[dict]) -> dict:
    """Per part, time = work at the full peak / utilization + counts x fixed costs, solved by
    least squares over the calibration runs. rollout: [work, decode steps, sequence-steps];
    update: [work, layer passes, layer passes at ZeRO-3]; sync: [bytes over the link, 1]."""
    import numpy as np

    def solve(part):
        """Least squares with every coefficient >= 0 (a rate's inverse, fixed costs): the best
        of the fits on each subset of the terms whose coefficients all come out >= 0."""
        from itertools import combinations

        a = np.array([r[part] for r in runs])
        b = np.array([r["measured"][part] for r in runs])
        best = None
        for k in range(1, a.shape[1] + 1):
            for cols in combinations(range(a.shape[1]), k):
                coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
                if (coef < 0).any():
                    continue
                full = np.zeros(a.shape[1])
                full[list(cols)] = coef
                error = float(np.sum((a @ full - b) ** 2))
                if best is None or error < best[0]:
                    best = (error, full)
        return [float(x) for x in best[1]]

    roll, upd, syn = solve("rollout"), solve("update"), solve("sync")
    return {"train": 1 / upd[0], "decode": 1 / roll[0], "prefill": 1 / roll[0], "sync": 1 / syn[0],
            "decode_step_overhead": roll[1], "decode_sequence_overhead": roll[2],
            "layer_pass_overhead": upd[1], "zero3_pass_overhead": upd[2],
            "sync_overhead": syn[1]}


def predicted(run: dict, c: dict) -> dict:
    coef = {"rollout": [1 / c["decode"], c["decode_step_overhead"], c["decode_sequence_overhead"]],
            "update": [1 / c["train"], c["layer_pass_overhead"], c["zero3_pass_overhead"]],
            "sync": [1 / c["sync"], c["sync_overhead"]]}
    return {k: sum(x * y for x, y in zip(run[k], coef[k])) for k in PARTS}


def split_check(out: Path) -> None:
    cal = {name: split_run(name, ov, out) for name, ov in CALIBRATION.items()}
    c = fit(list(cal.values()))
    print("fitted on the calibration runs: utilization train {train:.3f}, rollout {decode:.3f}, "
          "sync {sync:.3f}; fixed costs: decode step {decode_step_overhead:.5f} s + "
          "{decode_sequence_overhead:.6f} s a sequence, layer pass {layer_pass_overhead:.5f} s "
          "(+ {zero3_pass_overhead:.5f} s at ZeRO-3), sync {sync_overhead:.4f} s".format(**c))
    print("| run | | rollout s | update s | sync s |")
    print("| --- | --- | --- | --- | --- |")
    for name, ov in {**CALIBRATION, **CHECKED}.items():
        run = cal.get(name) or split_run(name, ov, out)
        pred = predicted(run, c)
        role = "calibration" if name in cal else "checked"
        print(f"| {name} ({role}) | measured | "
              + " | ".join(f"{run['measured'][k]:.3f}" for k in PARTS) + " |")
        print("| | predicted (fit) | " + " | ".join(f"{pred[k]:.3f}" for k in PARTS) + " |")
        print("| | predicted / measured | "
              + " | ".join(f"{pred[k] / run['measured'][k]:.2f}" for k in PARTS) + " |")
        print("| | plan.json (the constants it ran with) | "
              + " | ".join(f"{run['planned'][k]:.3f}" for k in PARTS) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen2,bench-100m")
    ap.add_argument("--rows", default="0,2,3")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--split", action="store_true",
                    help="the step split instead: fit the CPU's constants, check two presets")
    ap.add_argument("--out", default="/tmp/plan_check", help="where the --split runs go")
    args = ap.parse_args()
    cpu = "AMX" if "amx_bf16" in Path("/proc/cpuinfo").read_text() else "no AMX"
    if args.split:
        print(f"rl-plan's step split against this machine ({os.cpu_count()} cores, {cpu})")
        split_check(Path(args.out))
        return
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
