"""Integration tests run the real vLLM, DeepSpeed and Ray on tiny local models.

One Ray instance serves the whole session, and one cache of built models and warm-ups
($RL_CACHE_DIR, a temporary directory): a model or warm-up that two tests ask for alike is
built once. In-process runs take their actors from one PlacementPool (`placements`): a test
whose point is not the actors' start-up starts on actors an earlier test of the same shape
used (their models are built anew: only processes, imports and the process group are shared).
"""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def quiet_engines():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """The session's model and warm-up cache (set before Ray starts: actors inherit it)."""
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("RL_CACHE_DIR")
    os.environ["RL_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RL_CACHE_DIR", None)
    else:
        os.environ["RL_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def runs_with_integration(shared_cache):
    """The early runs registered `with_integration` (tests/early.py) start with the first
    integration test, in the session's cache."""
    from tests import early

    early.start_selected(with_integration=True)


# Logical CPUs of the session's Ray: room for the placements of several shapes (0.5 CPU per
# actor) to be kept side by side; the cores are the machine's either way. A kept actor holds
# ~0.75 GB (its imports), so at most 10 are kept.
RAY_CPUS = 8
MAX_IDLE_ACTORS = 10


@pytest.fixture(scope="session")
def ray_session(shared_cache):
    import ray

    from rl.config import load_config
    from rl.run.cluster import start_ray

    start_ray(load_config(None), num_cpus=RAY_CPUS)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def placements(ray_session):
    """The session's PlacementPool: pass it to Controller(placements=...), or take a placement
    with placements.start(cfg) and hand it back with placement.release()."""
    from rl.run.pool import PlacementPool

    pool = PlacementPool(MAX_IDLE_ACTORS)
    yield pool
    pool.close()
