"""The run's typed configuration: the schema (rl.schema) merged from YAML and `key=value`
overrides, then checked. Unknown keys and wrong types are errors that name the key and list what
is allowed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from rl.config_errors import ConfigError, explain, source_of
from rl.schema import PIPELINE_MODES, PLACEMENTS, Config, RunConfig
from rollout.config import CPU_LINEAR, LORA_RANKS
from weight_sync.checksums import CHECKSUMS


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Schema defaults <- YAML recipe <- key=value overrides, validated; returns a Config."""
    from pathlib import Path

    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(Config)
    layers = []
    try:
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"recipe '{path}' does not exist; give a YAML file (examples "
                                  f"in recipes/)")
            try:
                layers.append(OmegaConf.load(path))
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                line = f" at line {mark.line + 1}" if mark is not None else ""
                raise ConfigError(f"recipe '{path}' is not valid YAML{line} "
                                  f"({getattr(e, 'problem', None) or e}); fix the file") from None
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. rollout.n=8)")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, schema, path, overrides, layers)) from None
    recipe = layers[0] if path is not None else None
    for key, value, bound in out_of_bounds(cfg):
        want = "a finite number" if bound == "any" else f"a value {bound}"
        where = source_of(key, path, recipe, overrides)
        raise ConfigError(f"config key '{key}' = {value!r} ({where}) is out of range: give "
                          f"{want}")
    validate(cfg)
    return cfg


def within(value: float, bound: str) -> bool:
    """Whether value meets a field's declared bound: alternatives joined by ' or ', each '> x',
    '>= x', '< x', '<= x', 'in [a, b]' (round brackets: open ends), a bare number (that value),
    or 'any' (any finite number). NaN and infinities meet no bound."""
    if not math.isfinite(value):
        return False
    for rule in bound.split(" or "):
        rule = rule.strip()
        interval = re.fullmatch(r"in ([\[(])\s*([-\d.e]+),\s*([-\d.e]+)\s*([\])])", rule)
        compare = re.fullmatch(r"(>=|<=|>|<)\s*([-\d.e]+)", rule)
        if rule == "any":
            return True
        if interval:
            lo, hi = float(interval[2]), float(interval[3])
            if ((lo <= value if interval[1] == "[" else lo < value)
                    and (value <= hi if interval[4] == "]" else value < hi)):
                return True
        elif compare:
            x = float(compare[2])
            if {">": value > x, ">=": value >= x, "<": value < x, "<=": value <= x}[compare[1]]:
                return True
        elif value == float(rule):  # a bare number; anything else is a typo in the schema
            return True
    return False


def out_of_bounds(node, prefix: str = ""):
    """(key, value, bound) of every numeric field of a config (sections and lists of sections
    included) that is set and outside the bound its field declares (metadata["bound"])."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from out_of_bounds(value, key + ".")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from out_of_bounds(item, f"{key}[{i}].")
        elif ("bound" in f.metadata and isinstance(value, (int, float))
              and not isinstance(value, bool) and not within(value, f.metadata["bound"])):
            yield key, value, f.metadata["bound"]


def validate(cfg: Config) -> None:
    """Cross-field checks that neither a type nor a field's bound can express."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    split = cfg.ray.num_workers * cfg.algorithm.num_mini_batches
    if samples % split:
        raise ConfigError(
            f"rollout.prompts_per_step * rollout.n = {samples} samples do not split evenly over "
            f"ray.num_workers * algorithm.num_mini_batches = {split}; change one so it divides")
    ro = cfg.rollout
    if ro.max_new_tokens >= ro.max_model_len:
        raise ConfigError(f"rollout.max_new_tokens={ro.max_new_tokens} leaves no room for a prompt "
                          f"in rollout.max_model_len={ro.max_model_len} (prompt and response "
                          f"together): lower rollout.max_new_tokens below {ro.max_model_len}, or "
                          f"raise rollout.max_model_len to {ro.max_new_tokens} plus the longest "
                          f"prompt")
    algo = cfg.algorithm
    if algo.advantage == "gae" and not algo.critic:
        raise ConfigError("algorithm.advantage=gae needs a critic: set algorithm.critic=true")
    if algo.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer={algo.overlong_buffer} must be below "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    if cfg.rollout.n < 2 and algo.advantage in ("grpo", "dr_grpo", "rloo"):
        raise ConfigError(f"rollout.n={cfg.rollout.n}: group advantages need n >= 2")
    if cfg.placement not in PLACEMENTS:
        raise ConfigError(f"placement={cfg.placement!r} is not known; use one of: "
                          f"{', '.join(PLACEMENTS)}")
    if cfg.placement == "disaggregated" and cfg.ray.num_rollout_workers < 1:
        raise ConfigError(f"ray.num_rollout_workers={cfg.ray.num_rollout_workers}: a "
                          f"disaggregated run needs at least one rollout engine")
    if cfg.ray.cpu_malloc not in ("auto", "system") and not os.path.exists(cfg.ray.cpu_malloc):
        raise ConfigError(f"ray.cpu_malloc={cfg.ray.cpu_malloc!r} is no file; give auto, system "
                          f"or the path of a malloc library (e.g. libtcmalloc_minimal.so.4)")
    if cfg.sync.checksum not in CHECKSUMS:
        raise ConfigError(f"sync.checksum={cfg.sync.checksum!r} is not known; use one of: "
                          f"{', '.join(CHECKSUMS)}")
    if cfg.rollout.cpu_linear not in CPU_LINEAR:
        raise ConfigError(f"rollout.cpu_linear={cfg.rollout.cpu_linear!r} is not known; use one "
                          f"of: {', '.join(CPU_LINEAR)}")
    if algo.old_logprobs not in ("auto", "pass"):
        raise ConfigError(f"algorithm.old_logprobs={algo.old_logprobs!r}: use auto or pass")
    if cfg.trainer.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"trainer.dtype={cfg.trainer.dtype!r}: use float32 or bfloat16")
    if cfg.trainer.gradient_checkpointing not in (True, False, "auto"):
        raise ConfigError(f"trainer.gradient_checkpointing={cfg.trainer.gradient_checkpointing!r}"
                          f": use true, false or auto")
    if cfg.trainer.bf16_mode not in ("weights", "autocast"):
        raise ConfigError(f"trainer.bf16_mode={cfg.trainer.bf16_mode!r}: use weights or autocast")
    check_loggers(cfg.run)
    if cfg.ray.rollout_resources and cfg.placement != "disaggregated":
        raise ConfigError("ray.rollout_resources places rollout engines of their own: it needs "
                          "placement=disaggregated (colocated workers take ray.trainer_resources)")
    check_pipeline(cfg)
    check_speculation(cfg)
    check_eval(cfg)
    check_env_section(cfg)
    check_lora(cfg)
    if cfg.warmup.answer_noise and not [o for o in cfg.warmup.noise_offsets if o]:
        raise ConfigError(f"warmup.noise_offsets={cfg.warmup.noise_offsets}: a near miss needs a "
                          f"non-zero offset, e.g. [1] or [-3, -2, -1, 1, 2, 3]")


def check_colocated_tp(cfg: Config) -> None:
    """Colocated, a TP engine's ranks take the cores of tp workers (rl.run.colocated_worker).
    Checked by rl.preflight after the model's shape, which rules out more sizes."""
    tp, r = cfg.rollout.tensor_parallel_size, cfg.ray
    if tp == 1 or cfg.placement != "colocated":
        return
    key = f"rollout.tensor_parallel_size={tp}"
    if r.num_workers % tp:
        # the fix must pass the next check too, the samples' even split over the workers (and
        # mini-batches): a multiple of tp does only if tp itself does
        samples = cfg.rollout.prompts_per_step * cfg.rollout.n
        split = tp * cfg.algorithm.num_mini_batches
        fix = (f"set ray.num_workers={tp}, or use placement=disaggregated" if samples % split == 0
               else f"use placement=disaggregated (no multiple of {tp} workers splits the "
                    f"{samples} samples of a step into algorithm.num_mini_batches="
                    f"{cfg.algorithm.num_mini_batches})")
        raise ConfigError(f"{key}: colocated, each engine's {tp} TP ranks take the cores of {tp} "
                          f"workers; ray.num_workers={r.num_workers} is not a multiple of {tp}: "
                          f"{fix}")
    if r.num_gpus_per_worker:
        raise ConfigError(f"{key}: colocated TP engines run on CPU (an engine's process sees its "
                          f"own worker's GPU only); on GPUs use placement=disaggregated with "
                          f"ray.num_gpus_per_rollout_worker={tp}")


def check_pipeline(cfg: Config) -> None:
    pipe = cfg.pipeline
    if pipe.mode not in PIPELINE_MODES:
        raise ConfigError(f"pipeline.mode={pipe.mode!r} is not known; use one of: "
                          f"{', '.join(PIPELINE_MODES)}")
    if pipe.mode == "sync":
        return
    if cfg.placement != "disaggregated":
        raise ConfigError(f"pipeline.mode={pipe.mode} overlaps generation with the update, but "
                          f"placement={cfg.placement} runs both roles on the same cores, taking "
                          f"turns; set placement=disaggregated (or pipeline.mode=sync)")
    if cfg.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling resamples within a step, which the async "
                          "pipeline modes do not have; use pipeline.mode=sync for DAPO's "
                          "dynamic sampling")


def check_eval(cfg: Config) -> None:
    data, t = cfg.data, cfg.trainer
    if data.eval_path and data.eval_fraction:
        raise ConfigError("data.eval_path and data.eval_fraction both give a held-out set; "
                          "set one (data.eval_fraction=0 to use the file)")
    if t.eval_every and not (data.eval_path or data.eval_fraction):
        raise ConfigError(f"trainer.eval_every={t.eval_every} needs a held-out set: set "
                          f"data.eval_fraction (e.g. 0.1) or data.eval_path")
    if t.eval_every and cfg.pipeline.mode != "sync":
        raise ConfigError(f"trainer.eval_every={t.eval_every} with pipeline.mode="
                          f"{cfg.pipeline.mode}: the streaming engines evaluate only before the "
                          f"first step and after the last; set trainer.eval_every=0")


def check_env_section(cfg: Config) -> None:
    env = cfg.env
    if cfg.warmup.target_turns and env.name is None:
        raise ConfigError("warmup.target_turns scripts a multi-turn trajectory, which needs an "
                          "environment: set env.name (e.g. tools), or use warmup.target_template")
    if env.name is None:
        given = [k for k in ("tools", "args") if getattr(env, k)]
        if given:
            raise ConfigError(f"env.{given[0]} is set but env.name is not: set env.name=tools "
                              f"(or the environment's name) for multi-turn rollouts")
        return
    if env.turn_max_new_tokens is not None and (env.turn_max_new_tokens
                                                > cfg.rollout.max_new_tokens):
        raise ConfigError(f"env.turn_max_new_tokens={env.turn_max_new_tokens} exceeds the "
                          f"trajectory's budget rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}; lower it or raise the budget")


SYNC_LORA = ("adapters", "merged")


def check_lora(cfg: Config) -> None:
    if cfg.sync.lora not in SYNC_LORA:
        raise ConfigError(f"sync.lora={cfg.sync.lora!r} is not known; use one of: "
                          f"{', '.join(SYNC_LORA)}")
    lora = cfg.trainer.lora
    if lora is not None and cfg.sync.lora == "adapters" and lora.rank > max(LORA_RANKS):
        raise ConfigError(f"trainer.lora.rank={lora.rank} with sync.lora=adapters: vLLM's LoRA "
                          f"takes ranks up to {max(LORA_RANKS)}; lower the rank or use "
                          f"sync.lora=merged")
    if lora is not None and cfg.algorithm.critic:
        raise ConfigError("trainer.lora with algorithm.critic=true: the critic has no adapter "
                          "config (it would train in full beside a LoRA policy); use an "
                          "algorithm without a critic (e.g. algorithm.name=grpo) or drop "
                          "trainer.lora")


def check_speculation(cfg: Config) -> None:
    """Speculated tokens' logprobs are rescored by the engine's blocking generate only; what
    goes through rollout.stream's generation loop (the async pipeline modes, multi-turn
    rollouts) would train on the draft's logprobs."""
    spec = cfg.rollout.speculative_method
    loop = ([f"pipeline.mode={cfg.pipeline.mode}"] * (cfg.pipeline.mode != "sync")
            + [f"env.name={cfg.env.name}"] * (cfg.env.name is not None))
    if spec is not None and loop:
        raise ConfigError(f"rollout.speculative_method={spec} with {loop[0]}: the generation "
                          f"loop (async pipeline modes, multi-turn) does not rescore the "
                          f"speculated tokens' logprobs yet; drop the speculation or use "
                          f"pipeline.mode=sync without an env")


LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # name: package


def check_loggers(run: RunConfig) -> None:
    """Known logger names whose packages import, before anything heavy starts."""
    import importlib.util

    for name in run.loggers:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers has {name!r}; known: {', '.join(LOGGERS)}")
        package = LOGGERS[name]
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"run.loggers has {name!r} but the {package} package is not "
                              f"installed; pip install -e '.[log]' (scripts/setup.sh does)")


def grad_accum_steps(cfg: Config) -> int:
    """Micro-batches per rank per optimizer step, given the fixed rollout batch."""
    per_rank = cfg.rollout.prompts_per_step * cfg.rollout.n // (
        cfg.ray.num_workers * cfg.algorithm.num_mini_batches)
    return -(-per_rank // cfg.trainer.micro_batch_size)


def adapter_rank(cfg: Config) -> int:
    """The rank of the LoRA adapter that each sync loads into the engines (trainer.lora with
    sync.lora=adapters); 0: syncs move full weights."""
    lora = cfg.trainer.lora
    return lora.rank if lora is not None and cfg.sync.lora == "adapters" else 0


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
