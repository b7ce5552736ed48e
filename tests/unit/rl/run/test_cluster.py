"""Where the workers' allocator comes from (ray.cpu_malloc)."""
import ctypes.util

import pytest

from rl.config import ConfigError, load_config
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
