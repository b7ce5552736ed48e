"""Ray: a local instance or an existing cluster, and the colocated workers in a placement group."""
from __future__ import annotations

import math
import os

from rl.config import Config


def start_ray(cfg: Config) -> None:
    import ray

    from rl.models import cache_root

    if ray.is_initialized():
        return
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::FutureWarning",
           "RL_CACHE_DIR": str(cache_root())}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": env})
    else:
        need = math.ceil(cfg.ray.num_workers * cfg.ray.num_cpus_per_worker)
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 runtime_env={"env_vars": env})


def start_workers(cfg: Config) -> tuple[list, object]:
    """(workers, placement group): one colocated worker per rank, joined in one process group.

    Remove the placement group with `stop_workers` to give its resources back."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rl.worker import ColocatedWorker

    bundle = {"CPU": cfg.ray.num_cpus_per_worker}
    if cfg.ray.num_gpus_per_worker:
        bundle["GPU"] = cfg.ray.num_gpus_per_worker
    pg = placement_group([bundle] * cfg.ray.num_workers, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {cfg.ray.num_workers} workers of {bundle} in 300 s; the "
            f"cluster has {ray.cluster_resources()}. Lower ray.num_workers or the per-worker "
            f"resources.") from None
    actor = ray.remote(ColocatedWorker)
    workers = [actor.options(
        num_cpus=cfg.ray.num_cpus_per_worker, num_gpus=cfg.ray.num_gpus_per_worker,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
    ).remote(r, cfg.ray.num_workers) for r in range(cfg.ray.num_workers)]
    addr, port = ray.get(workers[0].rendezvous_address.remote())
    ray.get([w.init_distributed.remote(addr, port) for w in workers])
    return workers, pg


def stop_workers(workers: list, pg) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for w in workers:
        ray.kill(w)
    if pg is not None:
        remove_placement_group(pg)
