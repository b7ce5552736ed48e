"""PlacementPool: which kept placement a run gets, and which go."""
import pytest

from rl.config import load_config


class FakePlacement:
    """What PlacementPool reads of a placement: its config, actors, and stop()."""

    def __init__(self, cfg, actors: int = 2):
        self.cfg, self.stopped, self.rebound = cfg, False, []
        self._actors = [object() for _ in range(actors)]

    def actors(self):
        return self._actors

    def rebind(self, cfg):
        self.cfg = cfg
        self.rebound.append(cfg)

    def stop(self):
        self.stopped = True


@pytest.fixture
def pool(monkeypatch):
    """A PlacementPool whose placements are fakes: liveness and room are what the test says."""
    import rl.run.pool as pool_module

    started = []

    def start(cfg):
        started.append(FakePlacement(cfg))
        return started[-1]

    monkeypatch.setattr(pool_module, "start_placement", start)
    p = pool_module.PlacementPool(max_idle_actors=4)
    p.dead = set()
    monkeypatch.setattr(p, "_alive", lambda fake: fake not in p.dead)
    monkeypatch.setattr(p, "_make_room", lambda cfg: None)
    p.started = started
    return p


def test_a_kept_placement_serves_the_next_run_of_its_shape_only(pool):
    a = pool.start(load_config(None))
    pool.keep(a)
    other = pool.start(load_config(None, ["ray.num_workers=1"]))  # another shape: a new one
    assert other is not a and len(pool.started) == 2
    again = load_config(None, ["trainer.lr=0.5"])
    assert pool.start(again) is a and a.rebound == [again]  # same shape: the kept one
    assert pool.idle == [] and not a.stopped


def test_a_kept_placement_whose_actor_died_is_stopped_not_reused(pool):
    a = pool.start(load_config(None))
    pool.keep(a)
    pool.dead.add(a)
    b = pool.start(load_config(None))
    assert b is not a and a.stopped and not b.stopped


def test_at_most_max_idle_actors_are_kept_the_least_recently_used_go(pool):
    cfgs = [load_config(None, [f"ray.num_cpus_per_worker={c}"]) for c in (0.25, 0.5, 1.0)]
    a, b, c = (pool.start(cfg) for cfg in cfgs)
    pool.keep(a)
    pool.keep(b)
    assert not a.stopped and not b.stopped  # 4 actors: the limit
    pool.keep(c)
    assert a.stopped and pool.idle == [b, c]
    pool.close()
    assert b.stopped and c.stopped and pool.idle == []
