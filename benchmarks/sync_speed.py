"""Weight-sync speed in both placements, against the physical limits measured in the same run.

    .venv/bin/python benchmarks/sync_speed.py [--model builtin:bench-100m] [--bucket-mb 32]
                                               [--steps 20] [--tp 2]

1. Sync seconds of a ~100M-parameter model (fp32, ~400 MB), trainer (2 ZeRO-3 ranks) -> engines:
   colocated:     the engines' weights live once in shared memory and each trainer rank writes
                  its ZeRO-3 shards straight into them; the limit is bytes / memcpy bandwidth
                  measured in a worker;
   disaggregated: trainer rank 0 -> 2 engines over gloo (NCCL on GPU), buckets cut from the
                  engines' packed layout and received in place; the limit is
                  bytes / the bandwidth of a bare broadcast of the same bytes in the same bucket
                  size over the same group.
   Printed as sync / limit (target <= 2x). Syncs are timed without the probe check. Beside them,
   two floors of the paths the sync falls back to: a bare ZeRO-3 gather with DeepSpeed (what
   GPU or multi-host trainers do) and a bare engine load of the same tensors from memory (a
   copy into the parameters; vLLM's reload, which re-packs CPU linear weights for oneDNN, with
   rollout.cpu_linear=packed); and the sync's own phases (write, gather, checksum, wire, load).
   The engines keep plain CPU linears here (--cpu-linear plain): the transfer alone. With the
   default (repack) each engine also re-packs its linears for oneDNN after the write.
   --tp N: each placement at TP 1 and TP N, with one engine (colocated: N workers hold it,
   trainer rank r writes TP rank r's slice; disaggregated: one rollout engine, whose actor
   receives the buckets and writes each rank's slice), against the same limits as TP 1 (the
   model's bytes: memcpy, a bare broadcast; measured beside each, the better of the two taken);
   printed beside: the bytes written into each TP rank against TP 1's (target <= 0.55x) and
   sync / limit (target <= 2x).
2. The quickstart's step time breakdown (rollout, reward, update, sync) in both placements, the
   mean over --steps steps after the first (warm-up cached after the first run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def phases(metrics: dict) -> str:
    """The sync's own phases (write, gather, checksum, wire, load), as 'name 0.12s' pairs."""
    return "  ".join(f"{k.removeprefix('sync/').removesuffix('_seconds')} {v:.3f}s"
                     for k, v in metrics.items() if k.endswith("_seconds") and k != "sync/seconds")


def bench_sync(kind: str, model: str, bucket_mb: float, repeats: int, cpu_linear: str,
               dtype: str, tp: int = 1, one_engine: bool = False) -> dict:
    import probes
    import ray

    ray.cloudpickle.register_pickle_by_value(probes)  # the workers cannot import benchmarks/

    from rl.config import load_config
    from rl.run.placement import start_placement

    cfg = load_config(None, [f"placement={kind}", f"model.path={model}", f"sync.bucket_mb={bucket_mb}",
                             "ray.num_cpus_per_worker=0.5", "ray.num_cpus_per_rollout_worker=0.5",
                             "rollout.max_model_len=256", f"rollout.cpu_linear={cpu_linear}",
                             f"trainer.dtype={dtype}", f"rollout.dtype={dtype}",
                             f"rollout.tensor_parallel_size={tp}"]
                     + ([f"ray.num_workers={tp}"] if one_engine and kind == "colocated" else [])
                     + (["ray.num_rollout_workers=1"] if one_engine else [])
                     # bf16: the tolerance is calibrated on the base model, as a run does
                     + (["sync.tolerance=1e-2"] if dtype == "float32" else []))
    from rl.data.models import resolve_model_path

    path = resolve_model_path(model)
    placement = start_placement(cfg)
    try:
        ray.get([t.init_trainer.remote(path, cfg.trainer, cfg.algorithm.loss, 1, 1.0)
                 for t in placement.trainers])
        placement.init_rollout(path, 0)
        probe = list(range(3, 40))
        placement.measure_probe_noise(probe)
        first = placement.sync(1, probe)  # also warms the path up
        runs = [placement.sync(v, probe) for v in range(2, 2 + repeats)]
        times = [m["sync/seconds"] for m in runs]
        nbytes = int(first["sync/bytes"])
        if kind == "colocated":
            limit = ray.get(placement.trainers[0].call.remote(probes.measure_memcpy, nbytes))
            what = "memcpy"
        else:
            chunk = int(bucket_mb * 2**20)
            limit = max(ray.get([a.call.remote(probes.measure_broadcast, nbytes, chunk)
                                 for a in [placement.trainers[0]] + placement.engines]))
            what = "gloo broadcast" if cfg.ray.num_gpus_per_worker == 0 else "nccl broadcast"
        # the two ends' own floors: a bare ZeRO-3 gather, a bare engine reload from memory
        gather = max(ray.get([t.call.remote(probes.measure_gather, int(bucket_mb * 2**20))
                              for t in placement.trainers]))
        reload = math.nan if tp > 1 else max(ray.get(  # (the reload runs at TP 1 only)
            [e.call.remote(probes.measure_reload, path) for e in placement.engines]))
        best = min(times)
        probe_s = [m.get("sync/probe_trainer_seconds", math.nan)
                   + m.get("sync/probe_engine_seconds", 0)
                   for m in runs]  # colocated only: timed inside the workers
        return {"exact_s": statistics.median(m["sync/exact_seconds"] for m in runs),
                "exact_ranges": int(first["sync/exact_ranges"]),
                "probe_s": statistics.median(probe_s), "placement": kind, "bytes": nbytes,
                "tp": tp, "rank_bytes": int(first["sync/bytes_per_tp_rank"]),
                "buckets": int(first["sync/num_buckets"]),
                "sync_s": best, "sync_s_median": statistics.median(times), "limit_s": limit,
                "limit": what, "GBps_limit": nbytes / limit / 1e9, "ratio": best / limit,
                "probe_diff": first["sync/logprob_max_abs_diff"], "gather_s": gather,
                "reload_s": reload,
                "phases": phases(min(runs, key=lambda m: m["sync/seconds"]))}
    finally:
        placement.stop()


def bench_steps(kind: str, steps: int, out_dir: str) -> dict:
    from rl.config import load_config
    from rl.run.controller import Controller

    cfg = load_config(str(ROOT / "recipes" / "quickstart.yaml"), [
        f"placement={kind}", f"trainer.total_steps={steps + 1}", f"run.output_dir={out_dir}",
        f"run.name=bench-{kind}", "ray.num_cpus_per_worker=0.5",
        "ray.num_cpus_per_rollout_worker=0.5"])
    run_dir = Controller(cfg).run()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "time/step" in m][1:]  # RL steps (not the step-0 evaluation)
    keys = ["time/rollout", "time/reward", "time/update", "time/sync", "time/step"]
    return {"placement": kind, **{k: statistics.mean(m[k] for m in lines) for k in keys}}


def bench_tp(args) -> None:
    """Each placement with one engine at TP 1 and at TP args.tp: bytes per TP rank, sync / limit."""
    rows = []
    for kind in ("colocated", "disaggregated"):
        for tp in (1, args.tp):
            t0 = time.perf_counter()
            rows.append(bench_sync(kind, args.model, args.bucket_mb, args.repeats,
                                   args.cpu_linear, args.dtype, tp=tp, one_engine=True))
            print(f"[{kind} TP {tp}] measured in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nweight sync into one engine at TP 1 and TP {args.tp}, {args.model}, "
          f"{rows[0]['bytes'] / 2**20:.0f} MiB, buckets of {args.bucket_mb:g} MiB (best of "
          f"{args.repeats}); targets: bytes per TP rank <= 0.55x TP 1's, sync / limit <= 2")
    print(f"{'placement':<14}{'TP':>3}{'MiB/rank':>10}{'vs TP 1':>9}{'sync s':>9}{'limit s':>9}"
          f"  {'limit':<16}{'sync/limit':>11}{'probe Δ':>10}")
    for i, r in enumerate(rows):
        tp1 = rows[i - i % 2]
        # the same bytes and the same path at both sizes: the best of the two measurements
        limit = min(tp1["limit_s"], rows[i - i % 2 + 1]["limit_s"])
        print(f"{r['placement']:<14}{r['tp']:>3}{r['rank_bytes'] / 2**20:>10.1f}"
              f"{r['rank_bytes'] / tp1['rank_bytes']:>9.2f}{r['sync_s']:>9.3f}{limit:>9.3f}"
              f"  {r['limit']:<16}{r['sync_s'] / limit:>11.2f}{r['probe_diff']:>10.1e}")
    for r in rows:
        print(f"  {r['placement']} TP {r['tp']} phases (best sync): {r['phases']}")


def main() -> None:
    from rl.schema import SyncConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:bench-100m")
    p.add_argument("--bucket-mb", type=float, default=SyncConfig.bucket_mb,
                   help="bucket size (default: sync.bucket_mb's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="trainer and engines")
    p.add_argument("--steps", type=int, default=20, help="quickstart steps per placement (0: skip)")
    p.add_argument("--out", default="/tmp/rlstack-bench")
    p.add_argument("--cpu-linear", default="plain",
                   help="the engines' rollout.cpu_linear (plain: the transfer alone)")
    p.add_argument("--tp", type=int, default=1,
                   help="also sync into one engine at this tensor-parallel size, beside TP 1")
    args = p.parse_args()
    import ray

    from rl.config import load_config
    from rl.run.cluster import start_ray

    start_ray(load_config(None, ["placement=disaggregated", "ray.num_cpus_per_worker=0.5",
                                 "ray.num_cpus_per_rollout_worker=0.5"]))
    if args.tp > 1:
        bench_tp(args)
        ray.shutdown()
        return
    rows = []
    for kind in ("colocated", "disaggregated"):
        t0 = time.perf_counter()
        rows.append(bench_sync(kind, args.model, args.bucket_mb, args.repeats, args.cpu_linear,
                               args.dtype))
        print(f"[{kind}] measured in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nweight sync, {args.model}, {rows[0]['bytes'] / 2**20:.0f} MiB, buckets of "
          f"{args.bucket_mb:g} MiB (best of {args.repeats}; target sync / limit <= 2)")
    print(f"{'placement':<14}{'sync s':>9}{'median':>9}{'limit s':>9}  {'limit':<16}{'GB/s':>6}"
          f"{'sync/limit':>12}{'probe Δ':>10}")
    for r in rows:
        print(f"{r['placement']:<14}{r['sync_s']:>9.3f}{r['sync_s_median']:>9.3f}"
              f"{r['limit_s']:>9.3f}  {r['limit']:<16}{r['GBps_limit']:>6.2f}{r['ratio']:>12.2f}"
              f"{r['probe_diff']:>10.1e}")
    print("\nfloors of the fallback paths, measured beside: a bare DeepSpeed ZeRO-3 gather of "
          "every parameter, a bare engine load of the same bytes from memory")
    print(f"{'placement':<14}{'gather s':>10}{'load s':>10}{'sync/(gather+load)':>20}")
    for r in rows:
        print(f"{r['placement']:<14}{r['gather_s']:>10.3f}{r['reload_s']:>10.3f}"
              f"{r['sync_s'] / (r['gather_s'] + r['reload_s']):>20.2f}")
    for r in rows:
        print(f"  {r['placement']} phases (best sync): {r['phases']}")
    print(f"\nthe exact check after each sync ({args.dtype}; weight_sync.exact: XXH3 of each "
          f"(tensor, trainer rank) range on both sides; medians; target exact / sync <= 0.10)")
    print(f"{'placement':<14}{'sync s':>9}{'probe s':>9}{'exact s':>9}{'ranges':>8}"
          f"{'exact/sync':>12}{'exact/(sync+probe)':>20}")
    for r in rows:
        sync, exact = r["sync_s_median"], r["exact_s"]
        print(f"{r['placement']:<14}{sync:>9.3f}{r['probe_s']:>9.3f}{exact:>9.3f}"
              f"{r['exact_ranges']:>8}{exact / sync:>12.2f}{exact / (sync + r['probe_s']):>20.2f}")
    if args.steps:
        steps = [bench_steps(kind, args.steps, args.out) for kind in ("colocated", "disaggregated")]
        print(f"\nquickstart step time breakdown, mean of {args.steps} steps after the first (s)")
        keys = ["time/rollout", "time/reward", "time/update", "time/sync", "time/step"]
        print(f"{'placement':<14}" + "".join(f"{k.split('/')[1]:>10}" for k in keys))
        for r in steps:
            print(f"{r['placement']:<14}" + "".join(f"{r[k]:>10.3f}" for k in keys))
        print(f"{'disagg/coloc':<14}" + "".join(f"{steps[1][k] / steps[0][k]:>10.2f}"
                                                 for k in keys))
    ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
