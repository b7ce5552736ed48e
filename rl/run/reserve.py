"""Ray resources for a placement: one bundle per actor, the placement group that reserves them,
the actors started on it, the CPU cores each role gets, and what makes two runs' actors
interchangeable (`placement_shape`)."""
from __future__ import annotations

import json
import os

from rl.schema import Config


def bundle(cpus: float, gpus: float, resources: dict) -> dict:
    """One actor's reservation; custom `resources` pin it to the nodes that offer them."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **resources}


def reserve(wanted: list[dict], what: str):
    """A placement group of the `wanted` bundles, ready, or an error that says what to lower."""
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group(wanted, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {what} ({len(wanted)} bundles: {wanted}) in 300 s; the "
            f"cluster has {ray.cluster_resources()}. Lower ray.num_workers / "
            f"ray.num_rollout_workers or the per-worker resources, or start nodes that offer "
            f"the custom resources ray.trainer_resources / ray.rollout_resources ask "
            f"for.") from None
    return pg


def spawn(cls, pg, first_bundle: int, count: int, cpus: float, gpus: float,
          concurrency: int = 1, cores: tuple[int, int] | None = None) -> list:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(cls)
    return [actor.options(num_cpus=cpus, num_gpus=gpus, max_concurrency=concurrency,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              pg, placement_group_bundle_index=first_bundle + r)
                          ).remote(r, count, cores) for r in range(count)]


def split_cores(trainer_cpus: float, rollout_cpus: float,
                num_cpus: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, count) cores for the trainers and for the engines, in proportion to what Ray
    reserves for each role, at least one each (a single core is shared)."""
    total = num_cpus or os.cpu_count() or 1
    if total < 2:
        return (0, 1), (0, 1)
    share = trainer_cpus / (trainer_cpus + rollout_cpus)
    trainer = min(total - 1, max(1, round(total * share)))
    return (0, trainer), (trainer, total - trainer)


def join_trainers(trainers: list) -> None:
    import ray

    addr, port = ray.get(trainers[0].free_address.remote())
    ray.get([w.init_distributed.remote(addr, port) for w in trainers])


def bundles(cfg: Config) -> list[dict]:
    """One Ray bundle per actor of cfg's placement: trainer ranks first, then engines."""
    r = cfg.ray
    out = [bundle(r.num_cpus_per_worker, r.num_gpus_per_worker, r.trainer_resources)] * \
        r.num_workers
    if cfg.placement == "disaggregated":
        out += [bundle(r.num_cpus_per_rollout_worker, r.num_gpus_per_rollout_worker,
                       r.rollout_resources)] * r.num_rollout_workers
    return out


def split_roles(cfg: Config) -> bool:
    """Disaggregated on CPU: whether trainers and engines get cores of their own
    (ray.split_cores; by default only in the async modes, where both work at once)."""
    split = cfg.ray.split_cores
    return split if split is not None else cfg.pipeline.mode != "sync"


def placement_shape(cfg: Config) -> tuple:
    """What a placement's actors are started with: their kinds, number, resources, cores and
    concurrency, and the sync group's timeout. Runs whose configs agree here can run on the
    same actors (PlacementPool); everything else is set per run (init_trainer, init_rollout)."""
    shape = (cfg.placement, json.dumps(bundles(cfg), sort_keys=True))
    if cfg.placement == "disaggregated":
        shape += (split_roles(cfg), cfg.pipeline.mode == "sync", cfg.sync.timeout_s)
    return shape
