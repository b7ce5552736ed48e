"""Shared by the weight_sync tests: real vLLM layers built as if on a given TP rank."""
import importlib
from types import SimpleNamespace

import pytest


@pytest.fixture
def vllm_tp(monkeypatch):
    """vLLM layer modules, and at(rank, size) to make the next layer built think it is that rank.

    The layers and their parameters read the TP rank/size through names imported into these
    three modules; patching those avoids initializing torch.distributed.
    """
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    vocab = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
    modules = (linear, vocab, importlib.import_module("vllm.model_executor.parameter"))

    def at(rank, size):
        for m in modules:
            monkeypatch.setattr(m, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(m, "get_tensor_model_parallel_world_size", lambda: size)

    return SimpleNamespace(linear=linear, vocab=vocab, at=at)
