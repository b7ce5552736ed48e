"""Checks that run before anything heavy starts: every input that can be checked up front fails
here with one line that names the key, file or row and says the fix (rl-train exits 2).

Checked: registry names (advantage, policy loss, aggregation, KL estimator), the model path, a
`ray.address` that nothing answers at, the multi-turn environment and its tools, and the data
set (readable, not empty, each row an object with the prompt field, the rewards' own start
checks). What needs the tokenizer (prompt length, a chat template) is checked by the
controller before Ray starts. Warned, not refused: bfloat16
on a local CPU that has no bf16 kernels (correct, but many times slower than float32).
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from rl.config import ConfigError, check_colocated_tp
from rl.schema import Config


def check_names(cfg: Config) -> None:
    from rl.algo.advantages import ADVANTAGE_ESTIMATORS
    from update.losses import CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

    loss = cfg.algorithm.loss
    for key, name, registry in (("algorithm.advantage", cfg.algorithm.advantage,
                                 ADVANTAGE_ESTIMATORS),
                                ("algorithm.loss.policy_loss", loss.policy_loss, POLICY_LOSSES),
                                ("algorithm.loss.loss_agg", loss.loss_agg, LOSS_AGGREGATIONS),
                                ("algorithm.loss.kl_estimator", loss.kl_estimator, KL_ESTIMATORS),
                                ("algorithm.loss.correction", loss.correction, CORRECTIONS)):
        if name not in registry:
            raise ConfigError(f"{key}={name!r} is not registered; known: "
                              f"{', '.join(sorted(registry))}")


def check_model_path(cfg: Config) -> None:
    from rl.data.models import GGUF_MODELS, PRESETS, builtin_names

    path = cfg.model.path
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in PRESETS and name not in GGUF_MODELS:
            raise ConfigError(f"model.path={path!r} is not a built-in model; known: "
                              + ", ".join(builtin_names()))
        return
    if not Path(path).exists():
        raise ConfigError(f"model.path={path!r} does not exist; give a local Hugging Face model "
                          f"directory or builtin:<name>")
    if not (Path(path) / "config.json").exists():
        raise ConfigError(f"model.path={path!r} is not a Hugging Face model directory (no "
                          f"config.json); give the directory save_pretrained wrote")


def check_ray_address(cfg: Config, timeout_s: float = 3.0) -> None:
    """A host:port address must answer (Ray's GCS port); 'auto' is left to Ray."""
    address = cfg.ray.address
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r}: give host:port (the head's GCS port, 6379 "
                          f"by default) or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"ray.address={address!r}: nothing answers there ({e.strerror or e}); "
                          f"start the cluster (ray start --head) or fix the address") from None


def native_bf16() -> bool:
    """Whether this machine computes bfloat16 natively: a GPU, or a CPU whose oneDNN has bf16
    kernels (AVX-512 or AMX). On an AVX2-only CPU torch falls back to a scalar path: a
    SmolLM2-sized bf16 matmul took 100x its float32 time, an rl-train step 25x."""
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_warning(cfg: Config, native: bool) -> str | None:
    """The start-up warning for bfloat16 asked of a local machine that has no bf16 kernels (a
    warning, not a refusal: the run is correct, only slow); None when it does not apply (float32,
    native bf16, or workers on a cluster whose machines this one cannot speak for)."""
    keys = [f"{k}=bfloat16" for k, v in (("trainer.dtype", cfg.trainer.dtype),
                                         ("rollout.dtype", cfg.rollout.dtype)) if v == "bfloat16"]
    if not keys or native or cfg.ray.address:
        return None
    fix = " ".join(k.replace("bfloat16", "float32") for k in keys)
    return (f"warning: {' and '.join(keys)} on a CPU without bf16 kernels (AVX2, no AVX-512 or "
            f"AMX): bf16 matmuls run about 100x slower than float32 here; set {fix}")


def check_rows(cfg: Config, rows: list[dict], where: str = "train_path") -> None:
    key = cfg.data.prompt_key
    for i, row in enumerate(rows):
        if key not in row or row[key] is None:
            raise ConfigError(f"data.{where}={getattr(cfg.data, where)!r}: row {i} has no field "
                              f"{key!r} (data.prompt_key); its fields: {', '.join(row)}; set "
                              f"data.prompt_key or fix the row")


def engine_cores(cfg: Config, num_cpus: int | None = None) -> int:
    """Cores each rollout engine of a disaggregated CPU run binds (rl.run.role.Role): its share
    of the engines' cores (their own when the roles are split, else all of them)."""
    import os

    from rl.run.reserve import split_cores, split_roles

    r = cfg.ray
    total = num_cpus or os.cpu_count() or 1
    if split_roles(cfg):
        total = split_cores(r.num_workers * r.num_cpus_per_worker,
                            r.num_rollout_workers * r.num_cpus_per_rollout_worker, total)[1][1]
    return max(1, total // r.num_rollout_workers)


def model_tp_spec(path: str):
    """(model_type, query heads, tp -> TPSpec) of a Qwen2/Llama-shaped model path, from its
    config alone; (None, 0, None) for a built-in built at start (GGUF: vLLM checks it then)."""
    from rl.data.models import PRESETS
    from weight_sync.resharding import TPSpec

    name = path.removeprefix("builtin:")
    if path.startswith("builtin:") and name in PRESETS:
        p = PRESETS[name]
        return p.arch, p.num_heads, lambda t: TPSpec(t, p.num_heads, p.num_kv_heads,
                                                     p.hidden_size // p.num_heads,
                                                     p.intermediate_size, p.vocab_rows)
    if path.startswith("builtin:"):
        return None, 0, None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return (config.model_type, config.num_attention_heads,
            lambda t: TPSpec.from_hf_config(config, t))


def _constructs(spec, tp: int) -> bool:
    try:
        spec(tp)
    except ValueError:
        return False
    return True


def check_tensor_parallel(cfg: Config, num_cpus: int | None = None) -> None:
    """rollout.tensor_parallel_size against the model's shape first (heads, KV heads,
    intermediate size and padded vocab must divide it; a Qwen2/Llama model), then the workers a
    colocated engine takes and, on CPU, the engines' cores (a core per rank)."""
    tp = cfg.rollout.tensor_parallel_size
    if tp == 1:
        return
    from weight_sync.direct import DirectLoad

    key, path = f"rollout.tensor_parallel_size={tp}", cfg.model.path
    model_type, heads, spec = model_tp_spec(path)
    try:
        if spec is not None:
            spec(tp)
    except ValueError as e:
        fits = ", ".join(str(t) for t in range(1, heads + 1) if _constructs(spec, t))
        raise ConfigError(f"{key} does not fit model.path={path!r}: {e}; sizes that fit this "
                          f"model: {fits}") from None
    if model_type is not None and not DirectLoad.supports(model_type):
        raise ConfigError(f"{key}: syncs into TP engines know the Qwen2 and Llama families, not "
                          f"model_type {model_type!r}; use tensor_parallel_size=1")
    check_colocated_tp(cfg)
    if cfg.placement == "disaggregated" and not cfg.ray.num_gpus_per_rollout_worker:
        cores = engine_cores(cfg, num_cpus)  # colocated: a worker's cores per rank
        if cores < tp:
            raise ConfigError(
                f"{key} needs a core per TP rank: each of the {cfg.ray.num_rollout_workers} "
                f"rollout engine(s) gets {cores} core(s) here, which fits TP <= {cores}; lower "
                f"ray.num_rollout_workers or the TP size")


def check_env(cfg: Config) -> None:
    """env.name resolves to an environment class that env.tools/env.args make (a `python` tool
    checks the sandbox's isolation here)."""
    if cfg.env.name is None:
        return
    from envs.registry import env_factory

    try:
        env_factory(cfg.env)()
    except (ValueError, TypeError, ImportError) as e:
        where = "env.name" if "env '" in str(e) else "env.tools/env.args"
        raise ConfigError(f"{where} (env.name={cfg.env.name!r}): {e}") from None


def local_hardware(cfg: Config):
    """What this machine offers the run's workers, or None when they run elsewhere (a Ray
    cluster) or on GPUs this machine does not have: CPU workers its RAM (all of it: what other
    programs hold now is not the plan's to judge), GPU workers each GPU's memory."""
    from rl.plan.hardware import Hardware, meminfo
    from rl.plan.run import local_gpu

    if cfg.ray.address:
        return None
    if cfg.ray.num_gpus_per_worker or cfg.ray.num_gpus_per_rollout_worker:
        return local_gpu()
    # the figures beside the memory do not enter a fit
    return Hardware("cpu", memory_bytes=meminfo("MemTotal"), bandwidth=1e10,
                    bf16_flops=1e11, fp32_flops=1e11, intra_link=1e10, inter_link=1e9, gpu=False)


def plan_inputs(cfg: Config, rows: list[dict]):
    """(the model's shape, this machine as a cluster, the longest prompt's estimated tokens)
    for the run's plan; None where its workers run elsewhere (local_hardware). A config.json
    the planner cannot read raises ValueError."""
    hw = local_hardware(cfg)
    if hw is None:
        return None
    from rl.plan.plan import Cluster
    from rl.plan.report import model_shape
    from rl.plan.run import estimated_prompt_tokens

    return model_shape(cfg.model.path), Cluster(hw, 1, 1), estimated_prompt_tokens(cfg, rows)


def resolve_checkpointing(cfg: Config, inputs, why: str) -> None:
    """trainer.gradient_checkpointing=auto, settled from the run's plan on this machine
    (`inputs`: plan_inputs; rl.plan.plan.choose_checkpointing) and printed; false where there
    is no plan to ask, for the reason `why`."""
    if cfg.trainer.gradient_checkpointing != "auto":
        return
    if inputs is not None:
        from rl.plan.plan import resolve_auto

        print(resolve_auto(cfg, *inputs), flush=True)
        return
    cfg.trainer.gradient_checkpointing = False
    print(f"trainer.gradient_checkpointing=auto -> false: {why}", flush=True)


def check_fit(cfg: Config, inputs) -> None:
    """The run's plan (rl.plan; `inputs`: plan_inputs) against this machine's memory: one line
    with the need, the capacity and the smallest fix when it does not fit (run.fit_check=false
    skips it)."""
    if not cfg.run.fit_check or inputs is None:
        return
    from rl.plan.plan import fix_text, make_plan, smallest_fix

    plan = make_plan(cfg, *inputs)
    if plan.fits:
        return
    fix = smallest_fix(cfg, *inputs)
    raise ConfigError(f"the plan does not fit this machine: {plan.short}; smallest fix: "
                      f"{fix_text(fix) if fix else 'none found (more memory or devices)'} "
                      f"(rl-plan shows the plan; run.fit_check=false skips this check)")


def preflight(cfg: Config):
    """Every up-front check; returns the data set (rl.data.prompts.Rows: training and held-out rows,
    through the rewards' start checks)."""
    from rl.run.rewarding import checked_rows, load_rows

    try:  # the data first: these checks import nothing heavy
        train, held_out = loaded = load_rows(cfg)
        check_rows(cfg, train)  # before the split reads the prompts
        if held_out is not None:
            check_rows(cfg, held_out, "eval_path")
        rows = checked_rows(cfg, loaded)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    check_model_path(cfg)
    inputs = None
    why = "no local memory to plan against (a Ray cluster); set true where memory is short"
    if cfg.run.fit_check or cfg.trainer.gradient_checkpointing == "auto":
        try:
            inputs = plan_inputs(cfg, rows.train)
        except ValueError as e:  # a config.json the planner cannot read: vLLM's checks come later
            if cfg.run.fit_check:
                print(f"rl-train: no plan ({e})", file=sys.stderr, flush=True)
            why = f"no plan ({e})"
    resolve_checkpointing(cfg, inputs, why)
    check_fit(cfg, inputs)
    check_tensor_parallel(cfg)
    check_env(cfg)
    check_ray_address(cfg)
    check_names(cfg)  # imports torch (the registries live beside the math)
    warning = bf16_warning(cfg, native_bf16())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return rows
