"""Where the workers' allocator comes from (ray.cpu_malloc)."""
import ctypes.util

import pytest

from rl.config import ConfigError, load_config
from rl.placement import cpu_malloc


def test_auto_preloads_tcmalloc_on_cpu_only(monkeypatch):
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: found.get(name))
    assert cpu_malloc(load_config(None)) == "libtcmalloc_minimal.so.4"
    assert cpu_malloc(load_config(None, ["ray.num_gpus_per_worker=1"])) is None
    assert cpu_malloc(load_config(None, ["placement=disaggregated",
                                         "ray.num_gpus_per_rollout_worker=1"])) is None
    assert cpu_malloc(load_config(None, ["ray.cpu_malloc=system"])) is None
    found.clear()  # not installed: the system allocator, no error
    assert cpu_malloc(load_config(None)) is None


def test_a_given_library_is_used_and_a_missing_one_refused(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    assert cpu_malloc(load_config(None, [f"ray.cpu_malloc={lib}"])) == str(lib)
    with pytest.raises(ConfigError, match="ray.cpu_malloc='/nope.so' is no file"):
        load_config(None, ["ray.cpu_malloc=/nope.so"])


def test_the_shape_is_what_the_actors_are_started_with():
    """Runs of one shape can share actors; anything set per run (model, lr, rollout) does not
    change it, and what the actors are started with (count, resources, cores, concurrency)
    does."""
    from rl.placement import placement_shape

    base = placement_shape(load_config(None))
    assert placement_shape(load_config(None, ["trainer.lr=0.1", "rollout.n=4",
                                              "model.path=builtin:tiny-llama-tied"])) == base
    for other in (["ray.num_workers=1"], ["ray.num_cpus_per_worker=0.5"],
                  ["placement=disaggregated"], ["ray.trainer_resources={a: 1}"]):
        assert placement_shape(load_config(None, other)) != base, other
    sync = placement_shape(load_config(None, ["placement=disaggregated"]))
    for other in (["pipeline.mode=one_step"], ["ray.split_cores=true"],
                  ["ray.num_rollout_workers=1"], ["sync.timeout_s=5"]):
        assert placement_shape(load_config(None, ["placement=disaggregated", *other])) != sync


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
    import rl.placement as placement

    started = []

    def start(cfg):
        started.append(FakePlacement(cfg))
        return started[-1]

    monkeypatch.setattr(placement, "start_placement", start)
    p = placement.PlacementPool(max_idle_actors=4)
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
