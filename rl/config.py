"""The run's typed configuration: dataclasses merged from YAML and `key=value` overrides.

Each package owns its section's dataclass (rollout.config, update.config); this module composes
them. Defaults live here and nowhere else; unknown keys and wrong types are errors that name the
key and list what is allowed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from rollout.config import CPU_LINEAR, RolloutConfig
from update.config import LossConfig, TrainerConfig
from weight_sync.checksums import CHECKSUMS


@dataclass
class RunConfig:
    name: str = "run"
    "Run name: outputs go to <output_dir>/<name>/."
    output_dir: str = "runs"
    "Parent directory of run directories."
    seed: int = 0
    "Seed for data order, sampling and model building."
    log_samples: int = 2
    "Completions printed to rollouts.jsonl per step (all are kept when -1)."
    loggers: List[str] = field(default_factory=lambda: ["jsonl"])
    ("Where metrics go: jsonl (metrics.jsonl, always), tensorboard (event files in "
     "<run>/tensorboard), wandb (offline in <run>/wandb unless WANDB_API_KEY is set).")
    wandb_project: str = "rlstack"
    "W&B project of the run (with run.loggers including wandb)."
    timeline_steps: int = 20
    "RL steps recorded in timeline.json (Chrome trace; opens in Perfetto); 0 writes none."


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-qwen2"
    "A local Hugging Face model directory, or builtin:<preset> (built locally, cached)."


@dataclass
class DataConfig:
    train_path: str = "builtin:arithmetic"
    ("A .jsonl/.json/.parquet file of rows, builtin:arithmetic / builtin:fractions (generated), "
     "or reasoning_gym:<task> (a reasoning-gym task, e.g. basic_arithmetic, gsm_symbolic; "
     "pip install -e '.[tasks]').")
    prompt_key: str = "prompt"
    "Row field holding the prompt: a user message string or a list of chat messages."
    system_prompt: Optional[str] = None
    "A system message prepended to string prompts (None: no system message)."
    num_rows: int = 4000
    "Rows of builtin:arithmetic to generate."
    max_operand: int = 20
    "builtin:arithmetic operands lie in [0, max_operand]."
    task_config: Dict[str, Any] = field(default_factory=dict)
    ("reasoning_gym:<task>: the task's own settings (e.g. {min_terms: 2, max_terms: 3}); "
     "num_rows is its size, run.seed its seed.")
    answer_instruction: str = ""
    ("reasoning_gym:<task>: text appended to each question, e.g. 'Give the final answer inside "
     "<answer></answer>.' (the reasoning_gym reward scores the last <answer> block, else the "
     "whole response).")
    eval_path: Optional[str] = None
    ("Held-out prompts (a file like train_path): evaluated, never trained on; training rows with "
     "the same prompt text are dropped from RL and the warm-up.")
    eval_fraction: float = 0.0
    ("Without eval_path: hold out this fraction of the training file's distinct prompt texts "
     "(every row with a held-out text; the same texts whatever run.seed).")


@dataclass
class WarmupConfig:
    sft_steps: int = 0
    "Supervised steps on the task's answers before RL (0: start from model.path as is)."
    lr: float = 2e-3
    "Warm-up learning rate."
    batch_size: int = 64
    "Warm-up samples per optimizer step (all ranks together)."
    answer_noise: float = 0.0
    "Fraction of warm-up targets replaced by a near-miss number: a deliberately imperfect base."
    noise_offsets: List[int] = field(default_factory=lambda: [-3, -2, -1, 1, 2, 3])
    ("What a near-miss target adds to the answer, drawn uniformly; [1] makes a base model that "
     "is biased to answer one too many (a systematic error RL can correct).")
    target_template: str = "{answer}"
    "The warm-up response, formatted with the row's fields ({answer} is the possibly noisy one)."


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    "Algorithm name (shown in logs; the fields below define it)."
    advantage: str = "grpo"
    "Advantage estimator in rl.advantages.ADVANTAGE_ESTIMATORS (grpo, dr_grpo, rloo, reinforce_pp, gae)."
    norm_by_std: bool = True
    "grpo: divide group-centred rewards by the group std."
    eps: float = 1e-6
    "grpo: added to the group std."
    reinforce_pp_group_baseline: bool = False
    "reinforce_pp: subtract the group mean score first (REINFORCE++-baseline)."
    gamma: float = 1.0
    "Discount of token rewards (reinforce_pp, gae); 1.0 as in verl/OpenRLHF for LLMs."
    lam: float = 0.95
    "GAE lambda."
    critic: bool = False
    "Train a value model beside the policy (PPO); needed by advantage: gae."
    num_mini_batches: int = 1
    "Optimizer steps per epoch over the rollout batch (the batch is split into this many)."
    ppo_epochs: int = 1
    "Passes over the rollout batch per step (old logprobs are computed once, before them)."
    old_logprobs: str = "auto"
    ("auto: when the update is one optimizer step on the batch (1 epoch, 1 mini-batch, no critic, "
     "KL off or a loss term), old logprobs come from the training forward, detached, instead of a "
     "pass of their own (as TRL does); pass: always a separate forward before the update.")
    dynamic_sampling: bool = False
    "DAPO: drop groups whose rewards are all equal and sample more prompts to fill the batch."
    max_sampling_rounds: int = 4
    "Dynamic sampling: rollout rounds per step at most; then flat groups fill what is missing."
    overlong_buffer: int = 0
    "DAPO overlong shaping: tokens before rollout.max_new_tokens where a linear penalty starts; 0 = off."
    overlong_penalty: float = 1.0
    "Reward subtracted at full length under overlong shaping."
    loss: LossConfig = field(default_factory=LossConfig)
    "Policy loss, clipping, aggregation, KL, entropy and TIS."

    def one_pass(self) -> bool:
        """Whether old logprobs come from the training forward (see old_logprobs): only when
        they equal the current policy's there, and nothing before the update needs them."""
        kl_in_reward = self.loss.kl_coef > 0 and not self.loss.use_kl_loss
        return (self.old_logprobs == "auto" and self.ppo_epochs == 1
                and self.num_mini_batches == 1 and not self.critic and not kl_in_reward)


@dataclass
class RewardTerm:
    name: str = "exact_answer"
    "A built-in, an entry point (group rlstack.rewards), module:function or path/file.py:function."
    weight: float = 1.0
    "Weight of this term in the total reward."
    alias: Optional[str] = None
    "Metric name, reward/<alias>/mean (default: the function's name)."
    args: Dict[str, Any] = field(default_factory=dict)
    "Extra keyword arguments for the function (e.g. format's pattern, reward_model's path)."


@dataclass
class RewardConfig:
    functions: List[RewardTerm] = field(default_factory=lambda: [RewardTerm()])
    "The reward terms; the total reward is their weighted sum."
    fallback: float = 0.0
    "Value of a term whose call raised, timed out, or returned a non-number/NaN."
    timeout_s: float = 10.0
    "Wall-clock limit of one reward call (one sample, or one batch for batched rewards)."
    num_workers: int = 2
    "Processes that run reward calls in parallel."
    batch_size: int = 64
    "Samples per call of a batched reward."


@dataclass
class SyncConfig:
    bucket_mb: float = 32.0
    ("Largest bucket of weights in MiB where a sync goes by buckets (disaggregated; colocated "
     "only when the engines cannot share one copy of the weights); a sync holds two.")
    tolerance: Optional[float] = None
    ("Largest allowed |trainer - engine| probe logprob after a sync; None: by dtype "
     "(weight_sync.verify): 1e-3 when trainer and engines compute in float32; with bfloat16 on "
     "either side 5x the difference measured at start-up, when both hold the base model (bf16 "
     "noise: 0.01-0.02 nats on the tiny models, 0.25-0.42 on SmolLM2-135M), at least 0.25. "
     "The value used is the metric sync/tolerance, the start-up difference sync/probe_noise.")
    checksum: str = "sum64"
    "Disaggregated: per-bucket checksum verified on arrival (sum64: fast, on device; crc32)."
    timeout_s: float = 600.0
    "Disaggregated: seconds a sync-group operation may wait for a peer before it fails."


@dataclass
class RayConfig:
    address: Optional[str] = None
    "None: start a local Ray instance; 'auto' or host:port: join an existing cluster."
    num_workers: int = 2
    "Trainer ranks (DeepSpeed); colocated, each also holds one rollout engine."
    num_cpus_per_worker: float = 1.0
    "CPUs Ray reserves per trainer rank (colocated: per worker)."
    num_gpus_per_worker: float = 0.0
    "GPUs Ray reserves per trainer rank (1.0 on a GPU cluster)."
    num_rollout_workers: int = 2
    "Disaggregated: rollout engines (one vLLM each, in actors of their own)."
    num_cpus_per_rollout_worker: float = 1.0
    "Disaggregated: CPUs Ray reserves per rollout engine."
    num_gpus_per_rollout_worker: float = 0.0
    "Disaggregated: GPUs Ray reserves per rollout engine (1.0 on a GPU cluster)."
    trainer_resources: Dict[str, float] = field(default_factory=dict)
    ("Ray custom resources each trainer rank (colocated: each worker) asks for, e.g. "
     "{trainer_node: 1} with `ray start --resources '{\"trainer_node\": 2}'` on the nodes "
     "that should run them.")
    rollout_resources: Dict[str, float] = field(default_factory=dict)
    "Disaggregated: Ray custom resources each rollout engine asks for, e.g. {rollout_node: 1}."
    cpu_malloc: str = "auto"
    ("The memory allocator of CPU workers: auto (tcmalloc, preloaded, when libtcmalloc is "
     "installed, as vLLM's CPU backend recommends: training steps of SmolLM2-135M took 25-35% "
     "less time and generation 10% less; scripts/setup.sh installs it), system, or the path of "
     "a malloc library to preload. Runs on GPUs keep the system allocator under auto.")
    split_cores: Optional[bool] = None
    ("Disaggregated on CPU: pin the trainer ranks and the engines to cores of their own (in "
     "proportion to their CPU reservations) instead of every role using all cores; None: only "
     "in the async pipeline modes, where both roles work at once.")


@dataclass
class PipelineConfig:
    mode: str = "sync"
    ("sync: generate, then update, in lock-step; one_step: the next step's batch is generated "
     "while this step updates (max_staleness 1); fully_async: groups stream from the engines, "
     "the trainer takes the oldest finished ones within max_staleness. The async modes need "
     "placement=disaggregated.")
    max_staleness: int = 1
    ("fully_async: an update that starts from policy version u trains only on samples whose "
     "first token came from version v >= u - max_staleness (one_step is 1 whatever this says).")
    interruptible: bool = True
    ("Async modes: a weight sync interrupts sequences in flight, which go on under the new weights "
     "(their KV recomputed); False: the sync waits until the engine's sequences finish.")


PLACEMENTS = ("colocated", "disaggregated")
PIPELINE_MODES = ("sync", "one_step", "fully_async")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    placement: str = "colocated"
    "colocated: each worker holds a trainer rank and an engine; disaggregated: separate pools."


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message says the fix."""


def _known_keys(node) -> str:
    from omegaconf import OmegaConf

    try:
        return ", ".join(OmegaConf.to_container(node, resolve=False).keys())
    except Exception:  # a leaf, not a section: nothing to list
        return ""


def _explain(e, schema, path: str | None) -> str:
    """One line: the key, what was wrong, and what is allowed there."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    key = getattr(e, "full_key", None) or "?"
    where = f" (in {path})" if path else ""
    first = str(e).splitlines()[0]
    if isinstance(e, ConfigKeyError):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        section = OmegaConf.select(schema, parent) if parent else schema
        return (f"config key '{key}'{where} is not known: {first}; known keys"
                f"{' in ' + parent if parent else ''}: {_known_keys(section)}")
    default = OmegaConf.select(schema, key, default=None)
    hint = f"; give a {type(default).__name__} like the default {default!r}" \
        if isinstance(default, (int, float, str, bool)) else ""
    return f"config key '{key}'{where} has a wrong value: {first}{hint}"


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
        raise ConfigError(_explain(e, schema, path)) from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks a type cannot express."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    split = cfg.ray.num_workers * cfg.algorithm.num_mini_batches
    if samples % split:
        raise ConfigError(
            f"rollout.prompts_per_step * rollout.n = {samples} samples do not split evenly over "
            f"ray.num_workers * algorithm.num_mini_batches = {split}; change one so it divides")
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
    if cfg.trainer.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.zero_stage={cfg.trainer.zero_stage}: use 0 (no sharding), "
                          f"1, 2 or 3")
    if cfg.trainer.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"trainer.dtype={cfg.trainer.dtype!r}: use float32 or bfloat16")
    if cfg.trainer.bf16_mode not in ("weights", "autocast"):
        raise ConfigError(f"trainer.bf16_mode={cfg.trainer.bf16_mode!r}: use weights or autocast")
    check_loggers(cfg.run)
    if cfg.ray.rollout_resources and cfg.placement != "disaggregated":
        raise ConfigError("ray.rollout_resources places rollout engines of their own: it needs "
                          "placement=disaggregated (colocated workers take ray.trainer_resources)")
    check_pipeline(cfg)
    check_eval(cfg)
    if not 0.0 <= cfg.warmup.answer_noise <= 1.0:
        raise ConfigError(f"warmup.answer_noise={cfg.warmup.answer_noise}: use a value in [0, 1]")
    if cfg.warmup.answer_noise and not [o for o in cfg.warmup.noise_offsets if o]:
        raise ConfigError(f"warmup.noise_offsets={cfg.warmup.noise_offsets}: a near miss needs a "
                          f"non-zero offset, e.g. [1] or [-3, -2, -1, 1, 2, 3]")


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
    if pipe.max_staleness < 0:
        raise ConfigError(f"pipeline.max_staleness={pipe.max_staleness}: use 0 or more")
    if cfg.rollout.speculative_method is not None:
        raise ConfigError(f"rollout.speculative_method={cfg.rollout.speculative_method} with "
                          f"pipeline.mode={pipe.mode}: streaming engines do not rescore the "
                          f"speculated tokens' logprobs yet; drop the speculation or use "
                          f"pipeline.mode=sync")
    if cfg.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling resamples within a step, which the async "
                          "pipeline modes do not have; use pipeline.mode=sync for DAPO's "
                          "dynamic sampling")


def check_eval(cfg: Config) -> None:
    data, t = cfg.data, cfg.trainer
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction}: use a value in [0, 1) "
                          f"(0: no held-out split)")
    if data.eval_path and data.eval_fraction:
        raise ConfigError("data.eval_path and data.eval_fraction both give a held-out set; "
                          "set one (data.eval_fraction=0 to use the file)")
    if t.eval_every < 0 or t.eval_k < 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every}, trainer.eval_k={t.eval_k}: use 0 "
                          f"or more")
    if t.eval_every and not (data.eval_path or data.eval_fraction):
        raise ConfigError(f"trainer.eval_every={t.eval_every} needs a held-out set: set "
                          f"data.eval_fraction (e.g. 0.1) or data.eval_path")
    if t.eval_every and cfg.pipeline.mode != "sync":
        raise ConfigError(f"trainer.eval_every={t.eval_every} with pipeline.mode="
                          f"{cfg.pipeline.mode}: the streaming engines evaluate only before the "
                          f"first step and after the last; set trainer.eval_every=0")


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
    if run.timeline_steps < 0:
        raise ConfigError(f"run.timeline_steps={run.timeline_steps}: use 0 (none) or more")


def grad_accum_steps(cfg: Config) -> int:
    """Micro-batches per rank per optimizer step, given the fixed rollout batch."""
    per_rank = cfg.rollout.prompts_per_step * cfg.rollout.n // (
        cfg.ray.num_workers * cfg.algorithm.num_mini_batches)
    return -(-per_rank // cfg.trainer.micro_batch_size)


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
