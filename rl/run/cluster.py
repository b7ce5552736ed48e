"""Ray: joining a cluster (ray.address) or starting a local instance, and what every worker
process inherits from it (environment, allocator)."""
from __future__ import annotations

import math
import os

from rl.schema import Config


def cpu_malloc(cfg: Config) -> str | None:
    """The library the workers preload as their allocator (ray.cpu_malloc), or None."""
    choice = cfg.ray.cpu_malloc
    if choice == "system":
        return None
    if choice != "auto":
        return choice
    gpus = cfg.ray.num_gpus_per_worker or (cfg.placement == "disaggregated"
                                           and cfg.ray.num_gpus_per_rollout_worker)
    return None if gpus else tcmalloc()


def tcmalloc() -> str | None:
    """The installed tcmalloc library (the minimal build first), or None."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def start_ray(cfg: Config, num_cpus: int | None = None) -> None:
    """Join cfg's cluster, or start a local instance with num_cpus logical CPUs (None: the
    machine's cores, or what cfg's placement reserves if that is more)."""
    import ray

    from rl.data.models import cache_root

    if ray.is_initialized():
        return
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::FutureWarning",
           "RL_CACHE_DIR": str(cache_root()),
           # vLLM's ngram proposer runs numba's parallel loops; on numba's default (OpenMP)
           # layer a training step in the same process took 4.7x as long after one ngram
           # generate call. Its own thread pool leaves torch's alone.
           "NUMBA_THREADING_LAYER": "workqueue"}
    malloc = cpu_malloc(cfg)
    if malloc:  # the workers start with it (a library missing on some node is skipped there)
        env["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), malloc]))
        env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = str(1 << 40)  # no line per KV cache
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": env})
    else:
        need = cfg.ray.num_workers * cfg.ray.num_cpus_per_worker
        if cfg.placement == "disaggregated":
            need += cfg.ray.num_rollout_workers * cfg.ray.num_cpus_per_rollout_worker
        init_local(num_cpus=num_cpus or max(os.cpu_count() or 1, math.ceil(need)),
                   include_dashboard=False, runtime_env={"env_vars": env})


STARTUP_TRIES = 3


def init_local(**kwargs) -> None:
    """ray.init of a local instance, tried again when its raylet did not register in the 30 s
    Ray waits (a fixed wait: on a loaded 2-core machine, beside other runs' start-ups, it ran
    out). The half-started instance's processes are killed first."""
    import ray

    # The raylet starts a Python worker per CPU when the first driver connects, for tasks; an
    # actor here never takes one (each starts a worker of its own), so they only cost their
    # start-up and a process to keep (docs/cpu-notes.md). A value the user set stays.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Ray starts its workers at nice 15 (worker_niceness), to keep its own processes
    # responsive; here the workers are the run itself, and beside anything else at nice 0 (an
    # editor, a CI job, another program) they got about 1/28 of that CPU share: a 2-core
    # machine loaded 4x ran a 24 s check in 128 s at 0 and had not finished it in 280 s at 15.
    os.environ.setdefault("RAY_worker_niceness", "0")
    for attempt in range(1, STARTUP_TRIES + 1):
        try:
            return ray.init(**kwargs)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == STARTUP_TRIES:
                raise
            kill_half_started(e)
            print(f"ray: the local instance did not start ({e}); try {attempt + 1} of "
                  f"{STARTUP_TRIES}", flush=True)


def kill_half_started(error: BaseException) -> None:
    """Kill the processes of the ray Node whose start-up raised `error` (the Node is the `self`
    of a frame in its traceback; ray.init had not kept it, so ray.shutdown would not)."""
    from ray._private.node import Node

    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        tb = tb.tb_next
