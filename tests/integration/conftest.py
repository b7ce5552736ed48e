"""Integration tests run the real vLLM, DeepSpeed and Ray on tiny local models.

One Ray instance serves the whole session; runs write into a temporary cache/run directory.
"""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def quiet_engines():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from rl.config import load_config
    from rl.placement import start_ray

    start_ray(load_config(None))
    yield ray
    ray.shutdown()
