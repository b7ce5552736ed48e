"""What vLLM's CPU backend needs around it: how its linears keep their weights for in-place
syncs (rollout.cpu_linear), the patches a second engine in one process needs, a TP engine's
cores and leftover communicator files, and the KV cache's size (vLLM-CPU takes it in bytes)."""
from __future__ import annotations

import logging
import os

import torch

from rollout.config import RolloutConfig


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" on every in-place reload: the
    rotary cache is no checkpoint weight, and vLLM puts the kept one back. A real layer that
    misses its weights still warns (and fails the post-sync probe check)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights"
                    and record.args == ("RotaryEmbedding",))


# The cpu_linear mode of the engine being built: vLLM dispatches each linear while it loads.
_CPU_LINEAR = {"mode": "packed"}
# ... and how a TP engine's rank processes learn it (rollout.tp_worker)
CPU_LINEAR_ENV = "RL_CPU_LINEAR"


def set_cpu_linear_mode(mode: str) -> None:
    _CPU_LINEAR["mode"] = mode


def install_cpu_linear_dispatch() -> None:
    """Let each CPU engine choose how its unquantized linears run (rollout.cpu_linear).

    vLLM-CPU packs every linear weight into a oneDNN layout at load time and drops the weight,
    so new weights can only come in through its layerwise reload (fresh tensors, the loaders,
    the packing again: ~5x a memcpy for a 100M model here). `plain` keeps each weight as loaded
    and runs F.linear on it; `repack` keeps the weight *and* oneDNN's packed copy, and
    `VLLMEngine.weights_changed` re-packs after a sync has written the kept weights in place
    (oneDNN's handle holds a copy: it does not see writes). vLLM has no switch for this, so its
    dispatch function is wrapped for the process (engines run in-process on CPU); quantized and
    non-2-D weights keep vLLM's path.
    """
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "original", None) is not None:
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight, mode = layer.weight, _CPU_LINEAR["mode"]
        if mode == "packed" or weight.ndim != 2 or weight.is_meta or not weight.is_floating_point():
            return original(layer, remove_weight)
        if mode == "plain":
            layer.cpu_linear = torch.nn.functional.linear
            return
        original(layer, False)  # repack: the weight stays, so syncs can write into it
        layer.rl_repack = True

    dispatch.original = original
    utils.dispatch_cpu_unquantized_gemm = dispatch


def prepare_cpu_process(linear_mode: str) -> None:
    """Before a CPU engine starts: the engine in this process (weights can then be handed to its
    worker as tensors), its KV cache sized in bytes (kv_cache_bytes; VLLM_CPU_KVCACHE_SPACE, in
    whole GiB, would override that), and its linears in `linear_mode` (rollout.cpu_linear)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    patch_cpu_engine(linear_mode)


def patch_cpu_engine(linear_mode: str) -> None:
    """In a process that runs a CPU engine (or a TP engine's rank): vLLM's linear dispatch
    wrapped for `linear_mode`, AMX hidden from vLLM where oneDNN's ISA cap refuses its kernels,
    engine starts that survive llvmlite's proxy modules, vLLM's compiled helpers run eagerly,
    and one collection before each freeze of its heap."""
    install_cpu_linear_dispatch()
    amx_within_onednns_cap()
    tolerate_proxy_modules()
    eager_helpers()
    one_pass_gc_freeze()
    set_cpu_linear_mode(linear_mode)


# oneDNN's ISAs (ONEDNN_MAX_CPU_ISA's values) below AVX512_CORE_BF16, the first whose bf16
# brgemm has a kernel (probed cap by cap on an AMX Xeon); above it: AVX512_CORE_FP16, the AMX
# ones, AVX10_*, ALL. torch.ops.mkldnn._is_mkldnn_bf16_supported (rl.preflight.native_bf16)
# cannot tell: it says yes from AVX512_CORE, where the brgemm still has none.
ONEDNN_ISAS_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                          "AVX512_CORE_VNNI")


def onednn_caps_bf16_brgemm() -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA, its old name) caps oneDNN below
    AVX512_CORE_BF16, where torch's bf16 brgemm generates no kernel."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "")
    return cap.upper() in ONEDNN_ISAS_BELOW_BF16


def amx_within_onednns_cap() -> None:
    """vLLM takes its AMX kernels (bf16 attention, small linears) when
    `torch.cpu._is_amx_tile_supported()` says the CPU has AMX; they call torch's bf16 brgemm,
    which asks oneDNN, inside an OpenMP region. Under an ONEDNN_MAX_CPU_ISA below
    AVX512_CORE_BF16 (scripts/numerics_matrix.sh's avx2 and default settings, to compute as
    another CPU would) that brgemm refuses, and the refusal aborts the engine's process at its
    first batched generate. So in an engine's process AMX counts only where oneDNN may run it:
    vLLM then takes the kernels it takes on a CPU without AMX."""
    if onednn_caps_bf16_brgemm() and not hasattr(torch.cpu._is_amx_tile_supported, "original"):
        def no_amx() -> bool:
            return False

        no_amx.original = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = no_amx


def one_pass_gc_freeze() -> None:
    """vLLM collects generation 0, then 1, then 2 before it freezes the heap (twice in an
    engine's build). Built with the collector paused (rl.run.role.lasting), everything the
    build made sits in generation 0, so that is three passes over it: 1.39 CPU-s against
    0.56 for one full collection, measured over the ~1M objects of a process that imported
    torch, transformers, DeepSpeed and vLLM. One full collection, then the freeze: the same
    objects end frozen."""
    import gc

    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_worker

    def freeze_gc_heap() -> None:
        gc.collect()
        gc.freeze()

    core.freeze_gc_heap = gpu_worker.freeze_gc_heap = freeze_gc_heap


# vLLM's small helpers that it wraps in torch.compile of their own, outside the model's graph:
# a sampled (or prompt) token's rank among the logprobs, on every call that asks for logprobs
# (all of ours), and a TP rank's vocabulary mask. Each process compiled them on its first call
# (dynamo, inductor's cache key over torch's sources, the ISA probes' subprocesses): the
# engine's first generate took 2.6 CPU-s against 0.06 eager, every engine process of every run
# (docs/cpu-notes.md). Eager they run the same integer and comparison ops.
EAGER_HELPERS = (("vllm.v1.sample.sampler", "batched_count_greater_than"),
                 ("vllm.model_executor.layers.vocab_parallel_embedding",
                  "get_masked_input_and_mask"))


def eager_helpers() -> None:
    """Put back the plain functions behind EAGER_HELPERS' torch.compile wrappers (in a compiled
    model dynamo traces through the plain function as it did through the wrapper)."""
    import importlib

    for module_name, name in EAGER_HELPERS:
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def tolerate_proxy_modules() -> None:
    """Let a process start a second engine after llvmlite was imported (numba, which vLLM's
    ngram speculation runs on). Every engine start, vllm-cpu 0.32 re-binds its kernels by
    reading `vars()` of every attribute of every module; llvmlite's `ffi.lib` answers any
    attribute, `__dict__` included, with a function wrapper, and the start fails with
    "'_lib_fn_wrapper' object has no attribute 'get'". Such attributes are read as holding no
    kernel (they hold none)."""
    from vllm.triton_utils import dispatcher

    if "vars" in vars(dispatcher):
        return

    def plain_vars(obj) -> dict:
        found = vars(obj)
        return found if isinstance(found, dict) else {}

    dispatcher.vars = plain_vars


def repack_linears(model: torch.nn.Module) -> None:
    """Re-pack every linear that keeps oneDNN's packed copy beside its weight (cpu_linear=repack),
    after new weights were written into the weights in place."""
    from vllm.model_executor.layers import utils

    repack = getattr(utils.dispatch_cpu_unquantized_gemm, "original", None)
    if repack is not None:
        for module in model.modules():
            if getattr(module, "rl_repack", False):
                repack(module, False)


def remove_stale_shm(directory: str = "/dev/shm", prefix: str = "vllm_dist_",
                     min_age_s: float = 60.0) -> int:
    """Remove vLLM's CPU TP communicator files (`vllm_dist_<id>-tp:..-cpushm_<rank>`, 4 MiB each)
    that no process of ours maps and that are older than min_age_s: an engine that was killed
    leaves them (a closed one removes its own). Returns how many went."""
    import glob
    import time

    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)")
                              for line in f if f"{directory}/{prefix}" in line)
        except OSError:  # gone, or not ours to read (then its files are not ours to remove)
            continue
    removed, now = 0, time.time()
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if not name.startswith(prefix) or path in mapped:
            continue
        try:
            if now - os.stat(path).st_mtime >= min_age_s:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def tp_core_binding(tp_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a TP engine's ranks: this process's cores (its own binding
    "a-b" where rlstack set one, else its CPU affinity) split into tp_size runs, "0|1"."""
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if "-" in bound and "|" not in bound and "," not in bound:
        first, last = map(int, bound.split("-"))
        cores = list(range(first, last + 1))
    else:
        cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp_size:
        raise ValueError(f"rollout.tensor_parallel_size={tp_size} needs a core per TP rank; "
                         f"this engine has {len(cores)} ({cores}): give each rollout engine "
                         f"{tp_size} or more cores, or lower the tensor-parallel size")
    per = len(cores) // tp_size
    runs = [cores[r * per:(r + 1) * per] for r in range(tp_size)]
    return "|".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def tp_rank_env(tp_size: int, core_binding: str | None, linear_mode: str) -> tuple[str, dict]:
    """(the ranks' cores, "0|1"; the environment the rank processes of a CPU TP engine start
    with). Killed engines' communicator files are removed first."""
    remove_stale_shm()
    binding = core_binding or tp_core_binding(tp_size)
    if len(binding.split("|")) != tp_size:
        raise ValueError(f"core_binding={binding!r} binds {len(binding.split('|'))} ranks, not "
                         f"{tp_size}: separate each TP rank's cores by '|'")
    return binding, {CPU_LINEAR_ENV: linear_mode, "VLLM_CPU_OMP_THREADS_BIND": binding}


# vLLM-CPU's max_num_seqs for the LLM class (vllm.engine.arg_utils): sequences batched at once
CPU_MAX_NUM_SEQS = 256


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """Bytes of keys and values one token takes over all of a model's layers."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if dtype == "auto":
        dtype = str(getattr(c, "torch_dtype", None) or getattr(c, "dtype", None) or "float32")
    size = torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * size


def kv_cache_bytes(cfg: RolloutConfig, model_path: str) -> int:
    """An engine's KV cache on CPU: what CPU_MAX_NUM_SEQS sequences of max_model_len tokens
    take (a draft model's layers included), at most rollout.kv_cache_gib."""
    per_token = kv_bytes_per_token(model_path, cfg.dtype)
    if cfg.speculative_method == "draft" and cfg.draft_model:
        per_token += kv_bytes_per_token(cfg.draft_model, cfg.dtype)
    need = CPU_MAX_NUM_SEQS * cfg.max_model_len * per_token
    return int(min(need, cfg.kv_cache_gib * 2**30))
