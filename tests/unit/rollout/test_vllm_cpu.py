"""vLLM-CPU's surroundings (rollout.vllm_cpu): the pure parts (the engine runs in
tests/integration)."""
import logging
import os

import pytest

from rollout.vllm_cpu import RotaryReloadFilter


def record(layer: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING,
                             "layerwise.py", 266, "%s: Failed to load weights", (layer,), None)


def test_only_the_rotary_reload_warning_is_dropped():
    f = RotaryReloadFilter()
    assert not f.filter(record("RotaryEmbedding"))  # no checkpoint weight: noise on every sync
    assert f.filter(record("QKVParallelLinear"))  # a real layer without weights still warns


def test_the_kv_cache_is_what_256_sequences_of_max_model_len_need_at_most_kv_cache_gib(tmp_path):
    from rl.data.models import build_tiny_model
    from rollout.config import RolloutConfig
    from rollout.vllm_cpu import kv_bytes_per_token, kv_cache_bytes

    path = str(build_tiny_model("tiny-qwen2", out_dir=tmp_path / "m"))
    # keys and values: 2 layers x 2 KV heads x head_dim 32 (128 hidden / 4 heads) x 4 bytes
    assert kv_bytes_per_token(path, "float32") == 2 * 2 * 2 * 32 * 4
    assert kv_bytes_per_token(path, "bfloat16") == 2 * 2 * 2 * 32 * 2
    assert kv_cache_bytes(RolloutConfig(max_model_len=512), path) == 256 * 512 * 1024  # 128 MiB
    assert kv_cache_bytes(RolloutConfig(max_model_len=512, kv_cache_gib=0.0625), path) == 2**26
    draft = RolloutConfig(max_model_len=512, speculative_method="draft", draft_model=path)
    assert kv_cache_bytes(draft, path) == 2 * 256 * 512 * 1024  # the draft's layers too


def test_a_tp_engine_splits_its_cores_into_a_run_per_rank(monkeypatch):
    from rollout.vllm_cpu import tp_core_binding

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # as rl.run.role binds an actor
    assert tp_core_binding(2) == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4-7")
    assert tp_core_binding(2) == "4-5|6-7"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3-3")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs a core per TP rank"):
        tp_core_binding(2)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")  # no binding: the process's affinity
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        assert tp_core_binding(2).split("|")[0].startswith(str(cores[0]))


def test_stale_tp_communicator_files_go_mapped_and_new_ones_stay(tmp_path):
    import mmap
    import os
    import time

    from rollout.vllm_cpu import remove_stale_shm

    def made(name: str, age_s: float) -> str:
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return str(path)

    stale = made("vllm_dist_a-tp:0-[0-1]-cpushm_0", 600)
    young = made("vllm_dist_b-tp:0-[0-1]-cpushm_0", 1)
    other = made("psm_c", 600)
    in_use = made("vllm_dist_d-tp:0-[0-1]-cpushm_1", 600)
    with open(in_use, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # a live engine's: this process maps it
    assert remove_stale_shm(str(tmp_path)) == 1
    assert not os.path.exists(stale)
    assert all(os.path.exists(p) for p in (young, other, in_use))
    mapping.close()


def test_vllms_own_compiled_helpers_run_eagerly_in_a_cpu_engines_process():
    """A token's rank (every call with logprobs) and a TP rank's vocabulary mask: vLLM wraps
    each in a torch.compile of its own, which each engine process compiled on its first call
    (2.6 CPU-s against 0.06 eager). patch_cpu_engine (every CPU engine and TP rank process)
    puts the plain functions back; they compile nothing and give the same results."""
    import importlib

    import torch

    sampler = pytest.importorskip("vllm.v1.sample.sampler")
    from rollout.vllm_cpu import EAGER_HELPERS, patch_cpu_engine

    patch_cpu_engine("packed")
    for module, name in EAGER_HELPERS:
        assert not hasattr(getattr(importlib.import_module(module), name),
                           "_torchdynamo_orig_callable"), (module, name)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    logprobs = torch.log_softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(0)), -1)
    tokens = torch.tensor([0, 5, 39, 7, 7, 12])
    out = sampler.Sampler.gather_logprobs(logprobs, 2, tokens)
    picked = logprobs.gather(-1, tokens[:, None])
    assert torch.equal(out.selected_token_ranks, (logprobs >= picked).sum(-1))
    assert torch.equal(out.logprob_token_ids[:, 0], tokens.to(torch.int32))
    vocab = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
    ids, masked = vocab.get_masked_input_and_mask(torch.tensor([0, 3, 4, 9]), 2, 5, 0, 5, 5)
    assert ids.tolist() == [0, 1, 2, 0] and masked.tolist() == [True, False, False, True]
    assert not torch._dynamo.utils.counters["frames"], dict(torch._dynamo.utils.counters)


def test_vllm_freezes_an_engines_heap_after_one_collection_not_three():
    """Built with the collector paused, an engine's objects all sit in generation 0; vLLM's
    collect(0), collect(1), collect(2) passed over them three times (1.39 CPU-s against 0.56
    for one). patch_cpu_engine leaves one full collection, then the freeze."""
    import gc

    pytest.importorskip("vllm")
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_worker

    from rollout.vllm_cpu import patch_cpu_engine

    patch_cpu_engine("packed")
    for freeze in (core.freeze_gc_heap, gpu_worker.freeze_gc_heap):
        passes: list[int] = []

        def count(phase, info):
            if phase == "start":
                passes.append(info["generation"])

        gc.callbacks.append(count)
        try:
            freeze()
        finally:
            gc.callbacks.remove(count)
            gc.unfreeze()
        assert passes == [2]


@pytest.mark.parametrize("cap, capped", [("AVX2", True), ("sse41", True), ("AVX512_CORE", True),
                                         ("AVX512_CORE_VNNI", True), ("AVX512_CORE_BF16", False),
                                         ("AVX512_CORE_AMX", False), ("ALL", False), ("", False)])
def test_vllm_sees_amx_only_where_onednns_isa_cap_lets_torchs_bf16_brgemm_run(monkeypatch, cap,
                                                                              capped):
    """Under ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 torch's bf16 brgemm generates no kernel,
    and vLLM's AMX kernels (attention, small linears; chosen from
    torch.cpu._is_amx_tile_supported) abort the engine's process calling it:
    scripts/numerics_matrix.sh's avx2 setting on an AMX machine aborted three bf16 engine tests
    so. patch_cpu_engine hides AMX from vLLM then, and only then."""
    import torch

    from rollout.vllm_cpu import amx_within_onednns_cap, onednn_caps_bf16_brgemm

    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert onednn_caps_bf16_brgemm() == capped
    amx_within_onednns_cap()
    assert torch.cpu._is_amx_tile_supported() == (not capped)
