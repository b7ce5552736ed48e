"""The update step alone on 2 ranks (CPU, gloo; --ranks), per ZeRO stage: step time and each
rank's peak resident memory during the steps.

    .venv/bin/python benchmarks/update_zero.py --model bench-100m   # ~100M parameters (memory)
    .venv/bin/python benchmarks/update_zero.py --model tiny-qwen2   # the quickstart's model

`update.PolicyTrainer` as rl-train runs GRPO with a KL loss: one pass (old logprobs from the
training forward), the reference's forward inside the step, the shared-prompt layout, and the
post-sync probe (`sequence_logprobs`) after each step. The batch has the quickstart's shape:
per rank 16 prompts of ~20 tokens x 8 responses of 2-8 tokens, in one micro-batch. Each stage
runs in fresh processes (torch's threads: 1 per rank, as Ray gives each worker one CPU); the
peak is the resident set's high-water mark (VmHWM) from the first timed step on (reset after
start-up, which loads the whole model on every rank at any stage), per rank.

Rows: ZeRO-2; ZeRO-3 as configured by default (`3`: a model within
trainer.zero3_whole_model_max, 5e7 parameters, or on one rank, gathered whole for each forward and
backward, update.zero.EngineModule; a larger one module by module, each module's weights
released once used, trainer.zero3_release_params); and ZeRO-3 either way whatever the size
(`3-whole`: the bound 1e9; `3-modules`: the bound 0). Where the parameters dominate (bench-100m,
module by module by default on 2 ranks), ZeRO-3 should hold less than ZeRO-2; gathered whole it
holds a full copy during the step, module by module a layer or two. The ranks preload the
allocator rl-train's CPU workers get (ray.cpu_malloc auto: tcmalloc where installed; --malloc
system for glibc's): the resident peak depends on it."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    """Start the high-water mark again from the current resident set (Linux clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


ROWS = {"0": dict(zero_stage=0), "0-recompute": dict(zero_stage=0, gradient_checkpointing=True),
        "2": dict(zero_stage=2), "3": dict(zero_stage=3),
        "3-whole": dict(zero_stage=3, zero3_whole_model_max=10**9),
        "3-modules": dict(zero_stage=3, zero3_whole_model_max=0)}


def _worker(rank: int, world: int, port: int, path: str, row: str, steps: int,
            out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    from rl.algo.batch import Sample, collate
    from update.config import LossConfig, TrainerConfig
    from update.losses import BatchCounts
    from update.distributed import init_distributed
    from update.trainer import PolicyTrainer

    init_distributed(rank, world, "127.0.0.1", port)
    cfg = TrainerConfig(micro_batch_size=128, lr=5e-4, **ROWS[row])
    trainer = PolicyTrainer(path, cfg, LossConfig(kl_coef=0.001), grad_accum=1)
    rng = random.Random(rank)
    samples = []
    for g in range(16):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(18, 24))]
        for _ in range(8):
            response = [rng.randrange(3, 250) for _ in range(rng.randint(2, 8))]
            samples.append(Sample(g, g, prompt, response, [-1.0 - rng.random() for _ in response],
                                  "stop", "", advantages=[rng.gauss(0, 1)] * len(response)))
    batch = collate(samples, 0, share_prompts=True)
    counts = BatchCounts(float(batch["response_mask"].sum()) * world, 128.0 * world)
    probe = list(range(3, 40))
    times = []
    trainer.train_step([dict(batch)], counts)  # the first step builds the optimizer's state
    trainer.sequence_logprobs(probe)
    reset_peak()
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step([dict(batch)], counts)
        times.append(time.perf_counter() - t0)
        trainer.sequence_logprobs(probe)
    Path(out_dir, f"{row}-{rank}.json").write_text(json.dumps(
        {"step_s": sorted(times)[len(times) // 2], "peak_mib": peak_rss_mib(),
         "loss": metrics["loss/policy"]}))


def main() -> None:
    import torch.multiprocessing as mp

    from rl.data.models import PRESETS, build_tiny_model
    from rl.run.cluster import tcmalloc
    from rl.run.role import rendezvous_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-100m", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="2,3,3-whole,3-modules", help=f"of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per stage (median)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each stage, alternating")
    ap.add_argument("--ranks", type=int, default=2, help="ranks, 1 torch thread each")
    ap.add_argument("--malloc", default="auto",
                    help="auto (what rl-train's CPU workers preload), system, or a library")
    args = ap.parse_args()
    malloc = {"auto": tcmalloc(), "system": None}.get(args.malloc, args.malloc)
    if malloc:  # the spawned ranks start with it preloaded, as rl.run.cluster's workers do
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), malloc]))
    path = str(build_tiny_model(args.model))  # before any process group: rank 0 writes files
    out = tempfile.mkdtemp()
    cpu = ("amx_bf16" if "amx_bf16" in Path("/proc/cpuinfo").read_text() else "no AMX")
    world = args.ranks
    print(f"update step, {args.model}, {world} ranks x 1 thread, {os.cpu_count()} cores ({cpu}), "
          f"median of {args.steps} steps; peak resident memory per rank during the steps; "
          f"allocator {malloc or 'glibc'}")
    rows = {}
    for k in range(args.repeats):
        for row in args.rows.split(","):
            mp.spawn(_worker, args=(world, rendezvous_port(), path, row, args.steps, out),
                     nprocs=world)
            ranks = [json.loads(Path(out, f"{row}-{r}.json").read_text()) for r in range(world)]
            rows.setdefault(row, []).append(ranks)
            print(f"  ZeRO-{row} run {k + 1}: step {ranks[0]['step_s']:.3f} s, peak per rank "
                  + ", ".join(f"{r['peak_mib']:.0f}" for r in ranks) + " MiB", flush=True)
    print("\n| ZeRO stage | step s (per run) | "
          + " | ".join(f"peak MiB rank {r}" for r in range(world)) + " |")
    print("| --- | --- |" + " --- |" * world)
    for stage, runs in rows.items():
        steps = ", ".join(f"{r[0]['step_s']:.3f}" for r in runs)
        print(f"| {stage} | {steps} | " + " | ".join(
            f"{max(run[r]['peak_mib'] for run in runs):.0f}" for r in range(world)) + " |")
    for name in [r for r in rows if r != "2" and "2" in rows]:
        for k, (two, three) in enumerate(zip(rows["2"], rows[name])):
            ratio = three[0]["step_s"] / two[0]["step_s"]
            peaks = ", ".join(f"{three[r]['peak_mib'] / two[r]['peak_mib']:.2f}x"
                              for r in range(world))
            print(f"run {k + 1}: ZeRO-{name} / ZeRO-2 step {ratio:.2f}x, peak per rank {peaks}")


if __name__ == "__main__":
    main()
