"""The engine wrapper's pure parts (the engine itself runs in tests/integration)."""
import logging

from rollout.vllm_engine import _RotaryReloadFilter


def record(layer: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING,
                             "layerwise.py", 266, "%s: Failed to load weights", (layer,), None)


def test_only_the_rotary_reload_warning_is_dropped():
    f = _RotaryReloadFilter()
    assert not f.filter(record("RotaryEmbedding"))  # no checkpoint weight: noise on every sync
    assert f.filter(record("QKVParallelLinear"))  # a real layer without weights still warns
