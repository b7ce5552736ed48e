"""Placements kept between runs in one driver, so that a run starts on an earlier run's actors."""
from __future__ import annotations

from rl.run.placement import Placement, start_placement
from rl.run.reserve import bundles, placement_shape
from rl.schema import Config


class PlacementPool:
    """Placements kept between runs in one driver (a sweep, a notebook, the tests), so that a
    run whose placement shape (`placement_shape`) an earlier run had starts on its actors: no
    new processes, imports, or process group (about 15 s of a tiny run's 30 s on 2 cores).
    A kept placement holds no model (`Placement.release` frees them); the next run builds its
    own trainers and engines as a new placement would. When a new shape does not fit beside
    the kept ones, or more than `max_idle_actors` would be kept, the least recently used go."""

    def __init__(self, max_idle_actors: int = 6):
        self.max_idle_actors = max_idle_actors
        self.idle: list[Placement] = []  # least recently used first

    def start(self, cfg: Config) -> Placement:
        """A placement for cfg: a kept one of its shape whose actors still answer, else new."""
        shape = placement_shape(cfg)
        for p in [p for p in self.idle if placement_shape(p.cfg) == shape]:
            self.idle.remove(p)
            if self._alive(p):
                p.rebind(cfg)
                return p
            p.stop()
        self._make_room(cfg)
        placement = start_placement(cfg)
        placement.pool = self
        return placement

    def keep(self, placement: Placement) -> None:
        self.idle.append(placement)
        while sum(len(p.actors()) for p in self.idle) > self.max_idle_actors:
            self.idle.pop(0).stop()

    def close(self) -> None:
        """Stop every kept placement."""
        while self.idle:
            self.idle.pop().stop()

    def _make_room(self, cfg: Config) -> None:
        """Stop kept placements, oldest first, until Ray has the resources cfg's needs."""
        import ray

        need: dict[str, float] = {}
        for bundle in bundles(cfg):
            for k, v in bundle.items():
                need[k] = need.get(k, 0.0) + v
        while self.idle and any(ray.available_resources().get(k, 0.0) < v - 1e-9
                                for k, v in need.items()):
            self.idle.pop(0).stop()

    @staticmethod
    def _alive(placement: Placement) -> bool:
        import ray

        try:
            ray.get([a.hostname.remote() for a in placement.actors()], timeout=60)
            return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False
