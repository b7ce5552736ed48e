"""The plan of a resolved config on a named hardware and cluster (rl-plan, rl-train's preflight)."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from rl.plan.hardware import (PRESETS, Hardware, cpu_calibration, load_hardware, measure_cpu,
                              meminfo)
from rl.plan.plan import Cluster, Plan, make_plan, resolve_auto, smallest_fix, with_changes
from rl.plan.report import model_shape
from rl.schema import Config


def fill_devices(cfg: Config, overrides: list[str], devices: int) -> Config:
    """On GPUs given as --gpus-per-node/--nodes, the worker counts the user did not set fill
    them: colocated a trainer rank (and its engine share) per GPU; disaggregated half the GPUs
    train, the other half run engines of rollout.tensor_parallel_size GPUs."""
    given = {o.split("=", 1)[0] for o in overrides}
    changes = {}
    if cfg.placement == "colocated":
        if "ray.num_workers" not in given:
            changes["ray.num_workers"] = devices
    else:
        if "ray.num_workers" not in given:
            changes["ray.num_workers"] = max(1, devices // 2)
        if "ray.num_rollout_workers" not in given:
            changes["ray.num_rollout_workers"] = max(
                1, (devices - changes.get("ray.num_workers", cfg.ray.num_workers))
                // cfg.rollout.tensor_parallel_size)
    return with_changes(cfg, changes)


# a prompt's tokens from its text, before any tokenizer: BPE vocabularies take 3-4 characters a
# token on English text (3: more tokens, the safe side), and a chat template adds ~16 tokens
CHARS_PER_TOKEN = 3
TEMPLATE_TOKENS = 16


def estimated_prompt_tokens(cfg: Config, rows: list[dict]) -> int:
    """The longest prompt of rows, estimated from its characters, at most what the engine
    allows a prompt (max_model_len - max_new_tokens)."""
    key = cfg.data.prompt_key
    longest = max((len(r[key] if isinstance(r.get(key), str) else json.dumps(r.get(key)))
                   for r in rows), default=0)
    return min(cfg.rollout.max_model_len - cfg.rollout.max_new_tokens,
               -(-longest // CHARS_PER_TOKEN) + TEMPLATE_TOKENS)


def plan_for(cfg: Config, overrides: list[str], hardware: str = "cpu",
             gpus_per_node: int | None = None, nodes: int = 1, prompt_tokens: int | None = None,
             acceptance: float | None = None) -> tuple[Plan, dict | None]:
    """(the plan, the smallest fix when it does not fit)."""
    hw = load_hardware(hardware)
    shape = model_shape(cfg.model.path)
    per_node = (gpus_per_node or 8) if hw.gpu else 1
    if hw.gpu:
        cfg = fill_devices(cfg, overrides, per_node * nodes)
    cluster = Cluster(hw, nodes, per_node)
    note = resolve_auto(cfg, shape, cluster, prompt_tokens)
    plan = make_plan(cfg, shape, cluster, prompt_tokens, acceptance)
    plan.notes += [note] if note else []
    fix = None if plan.fits else smallest_fix(cfg, shape, cluster, prompt_tokens)
    return plan, fix


def local_gpu() -> Hardware | None:
    """This machine's first GPU as nvidia-smi reports it: a preset when its name says which,
    its memory either way; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, mib = (x.strip() for x in out[0].split(","))
    preset = next((PRESETS[k] for k in ("h200", "h100-80g", "a100-80g")
                   if k.split("-")[0] in name.lower()), PRESETS["h100-80g"])
    return replace(preset, name=name, memory_bytes=float(mib) * 2 ** 20)


def cached_cpu(cache_dir: Path) -> Hardware:
    """measure_cpu once per machine (its CPU model and cores), kept under cache_dir; the RAM
    is read anew, and the utilizations and fixed costs are this version's (a calibration
    reaches a machine that measured before it)."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), "cpu")
    # v2: bf16 measured (before it, bf16 was taken as float32)
    key = f"v2-{model}-{os.cpu_count()}".replace("/", "_").replace(" ", "_")
    file = cache_dir / "hardware" / f"{key}.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    # Runs started together (benchmarks/vs_trl.py --jobs, the test suite's) measure once, one
    # after the other, not each against the others' measurements; the lock dies with its holder
    with open(file.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if file.exists():
            hw = Hardware(**json.loads(file.read_text()))
        else:
            hw = measure_cpu()
            tmp = file.with_name(f"{file.name}.{os.getpid()}")
            tmp.write_text(json.dumps(hw.to_dict()))
            tmp.replace(file)
    return replace(hw, memory_bytes=meminfo("MemTotal"), **cpu_calibration())


def run_plan(cfg: Config, model_dir: str, prompt_tokens: int, cache_dir: Path) -> Plan:
    """A run's own plan (plan.json) of its model directory (a built-in resolved): on its GPUs
    when its workers take GPUs and this machine has them, else on this CPU (measured once,
    cached)."""
    gpu = (cfg.ray.num_gpus_per_worker or cfg.ray.num_gpus_per_rollout_worker) and local_gpu()
    hw = gpu or cached_cpu(cache_dir)
    return make_plan(cfg, model_shape(model_dir), Cluster(hw, 1, 1), prompt_tokens)


def plan_metrics(plan: Plan) -> dict:
    """The plan's figures beside what a step measures (memory/trainer_peak_rss_mib,
    rollout/kv_blocks, sync/bytes_per_tp_rank, time/rollout, time/update, time/sync)."""
    t = plan.time
    return {"plan/trainer_peak_rss_mib": plan.process_rss() / 2 ** 20,
            "plan/kv_blocks": float(plan.engine["kv_blocks"]),
            "plan/sync_bytes_per_tp_rank": t["sync"]["bytes_per_tp_rank"],
            "plan/time_rollout": t["rollout"]["seconds"],
            "plan/time_update": t["update"]["seconds"],
            "plan/time_sync": t["sync"]["seconds"]}
