"""Where the workers' allocator comes from (ray.cpu_malloc); a local Ray whose start-up timed
out is killed and started again."""
import ctypes.util
import os

import pytest

from rl.config import ConfigError, load_config
from rl.run import cluster
from rl.run.cluster import cpu_malloc


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


def test_a_local_start_that_timed_out_is_killed_and_tried_again(monkeypatch):
    import ray
    from ray._private.node import Node

    killed, calls = [], []

    class HalfStarted(Node):  # what ray.init's Node does when its raylet never registers
        def __init__(self):
            raise Exception("The current node timed out during startup. This could happen ...")

        def kill_all_processes(self, **kwargs):
            killed.append(self)

    def init(fails: int, error=HalfStarted):
        def fake(**kwargs):
            calls.append(kwargs)
            if len(calls) <= fails:
                error()
        return fake

    monkeypatch.setattr(ray, "init", init(fails=2))
    cluster.init_local(num_cpus=2)
    assert len(calls) == 3 and len(killed) == 2 and calls[-1] == {"num_cpus": 2}
    killed.clear(), calls.clear()
    monkeypatch.setattr(ray, "init", init(fails=3))
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.init_local()
    assert len(calls) == cluster.STARTUP_TRIES
    calls.clear()

    def other():
        raise RuntimeError("bad runtime_env")
    monkeypatch.setattr(ray, "init", init(fails=1, error=other))  # any other error: no retry
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        cluster.init_local()
    assert len(calls) == 1


@pytest.mark.parametrize("key, default, users", [
    # its actors each start a worker of their own: no idle workers prestarted for the driver
    ("RAY_prestart_worker_first_driver", "0", "1"),
    # not Ray's nice 15, which left the run's actors a fraction of a loaded core
    # (tests/integration/test_fast_step.py checks the actors' niceness on the real Ray)
    ("RAY_worker_niceness", "0", "10"),
])
def test_a_local_instances_raylet_gets_the_runs_defaults(monkeypatch, key, default, users):
    """The raylet reads RAY_* from the environment it starts with; a user's value stays."""
    import ray

    seen = []
    monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(os.environ.get(key)))
    cluster.init_local(num_cpus=2)
    assert seen == [default]
    monkeypatch.setenv(key, users)
    cluster.init_local(num_cpus=2)
    assert seen == [default, users]
