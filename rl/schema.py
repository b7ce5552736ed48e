"""The run's config schema: one dataclass per section, each field with its type, default and a
one-line docstring. Each package owns its section's dataclass (rollout.config, update.config);
this module composes them. Defaults live here and nowhere else; rl.config loads and checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from envs.config import EnvConfig
from rollout.config import RolloutConfig
from update.config import LossConfig, TrainerConfig


@dataclass
class RunConfig:
    name: str = "run"
    "Run name: outputs go to <output_dir>/<name>/."
    output_dir: str = "runs"
    "Parent directory of run directories."
    seed: int = field(default=0, metadata={"bound": ">= 0"})
    "Seed for data order, sampling and model building."
    log_samples: int = field(default=2, metadata={"bound": ">= -1"})
    "Completions printed to rollouts.jsonl per step (all are kept when -1)."
    loggers: List[str] = field(default_factory=lambda: ["jsonl"])
    ("Where metrics go: jsonl (metrics.jsonl, always), tensorboard (event files in "
     "<run>/tensorboard), wandb (offline in <run>/wandb unless WANDB_API_KEY is set).")
    wandb_project: str = "rlstack"
    "W&B project of the run (with run.loggers including wandb)."
    timeline_steps: int = field(default=20, metadata={"bound": ">= 0"})
    "RL steps recorded in timeline.json (Chrome trace; opens in Perfetto); 0 writes none."
    fit_check: bool = True
    ("Before Ray starts, refuse a run whose plan (rl-plan) does not fit this machine's RAM (CPU "
     "workers) or each GPU's memory (GPU workers), naming the smallest fix; false skips it "
     "(docs/planning.md).")


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
    num_rows: int = field(default=4000, metadata={"bound": ">= 1"})
    "Rows of builtin:arithmetic to generate."
    max_operand: int = field(default=20, metadata={"bound": ">= 0"})
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
    eval_fraction: float = field(default=0.0, metadata={"bound": "in [0, 1)"})
    ("Without eval_path: hold out this fraction of the training file's distinct prompt texts "
     "(every row with a held-out text; the same texts whatever run.seed).")


@dataclass
class WarmupConfig:
    sft_steps: int = field(default=0, metadata={"bound": ">= 0"})
    "Supervised steps on the task's answers before RL (0: start from model.path as is)."
    lr: float = field(default=2e-3, metadata={"bound": "> 0"})
    "Warm-up learning rate."
    batch_size: int = field(default=64, metadata={"bound": ">= 1"})
    "Warm-up samples per optimizer step (all ranks together)."
    answer_noise: float = field(default=0.0, metadata={"bound": "in [0, 1]"})
    "Fraction of warm-up targets replaced by a near-miss number: a deliberately imperfect base."
    noise_offsets: List[int] = field(default_factory=lambda: [-3, -2, -1, 1, 2, 3])
    ("What a near-miss target adds to the answer, drawn uniformly; [1] makes a base model that "
     "is biased to answer one too many (a systematic error RL can correct).")
    target_template: str = "{answer}"
    "The warm-up response, formatted with the row's fields ({answer} is the possibly noisy one)."
    target_turns: List[str] = field(default_factory=list)
    ("Multi-turn (env.name set): the model turns of a scripted trajectory instead, each formatted "
     "like target_template (literal braces doubled: {{ }}); the environment answers every turn "
     "but the last, as in RL, and its observation tokens are masked out of the loss.")


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    "Algorithm name (shown in logs; the fields below define it)."
    advantage: str = "grpo"
    "Advantage estimator in rl.algo.advantages.ADVANTAGE_ESTIMATORS (grpo, dr_grpo, rloo, reinforce_pp, gae)."
    norm_by_std: bool = True
    "grpo: divide group-centred rewards by the group std."
    eps: float = field(default=1e-6, metadata={"bound": "> 0"})
    "grpo: added to the group std."
    reinforce_pp_group_baseline: bool = False
    "reinforce_pp: subtract the group mean score first (REINFORCE++-baseline)."
    gamma: float = field(default=1.0, metadata={"bound": "in [0, 1]"})
    "Discount of token rewards (reinforce_pp, gae); 1.0 as in verl/OpenRLHF for LLMs."
    lam: float = field(default=0.95, metadata={"bound": "in [0, 1]"})
    "GAE lambda."
    critic: bool = False
    "Train a value model beside the policy (PPO); needed by advantage: gae."
    num_mini_batches: int = field(default=1, metadata={"bound": ">= 1"})
    "Optimizer steps per epoch over the rollout batch (the batch is split into this many)."
    ppo_epochs: int = field(default=1, metadata={"bound": ">= 1"})
    "Passes over the rollout batch per step (old logprobs are computed once, before them)."
    old_logprobs: str = "auto"
    ("auto: when the update is one optimizer step on the batch (1 epoch, 1 mini-batch, no critic, "
     "KL off or a loss term), old logprobs come from the training forward, detached, instead of a "
     "pass of their own (as TRL does); pass: always a separate forward before the update.")
    dynamic_sampling: bool = False
    "DAPO: drop groups whose rewards are all equal and sample more prompts to fill the batch."
    max_sampling_rounds: int = field(default=4, metadata={"bound": ">= 1"})
    "Dynamic sampling: rollout rounds per step at most; then flat groups fill what is missing."
    overlong_buffer: int = field(default=0, metadata={"bound": ">= 0"})
    "DAPO overlong shaping: tokens before rollout.max_new_tokens where a linear penalty starts; 0 = off."
    overlong_penalty: float = field(default=1.0, metadata={"bound": ">= 0"})
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
    weight: float = field(default=1.0, metadata={"bound": "any"})
    "Weight of this term in the total reward."
    alias: Optional[str] = None
    "Metric name, reward/<alias>/mean (default: the function's name)."
    args: Dict[str, Any] = field(default_factory=dict)
    "Extra keyword arguments for the function (e.g. format's pattern, reward_model's path)."


@dataclass
class RewardConfig:
    functions: List[RewardTerm] = field(default_factory=lambda: [RewardTerm()])
    "The reward terms; the total reward is their weighted sum."
    fallback: float = field(default=0.0, metadata={"bound": "any"})
    "Value of a term whose call raised, timed out, or returned a non-number/NaN."
    timeout_s: float = field(default=10.0, metadata={"bound": "> 0"})
    "Wall-clock limit of one reward call (one sample, or one batch for batched rewards)."
    num_workers: int = field(default=2, metadata={"bound": ">= 1"})
    "Processes that run reward calls in parallel."
    batch_size: int = field(default=64, metadata={"bound": ">= 1"})
    "Samples per call of a batched reward."


@dataclass
class SyncConfig:
    bucket_mb: float = field(default=32.0, metadata={"bound": "> 0"})
    ("Largest bucket of weights in MiB where a sync goes by buckets (disaggregated; colocated "
     "only when the engines cannot share one copy of the weights); a sync holds two.")
    tolerance: Optional[float] = field(default=None, metadata={"bound": "> 0"})
    ("Largest allowed |trainer - engine| probe logprob after a sync; None: by dtype "
     "(weight_sync.verify): 1e-3 when trainer and engines compute in float32; with bfloat16 on "
     "either side 5x the difference measured at start-up, when both hold the base model, at "
     "least 0.25 (docs/placement-and-weight-sync.md). The value used is the metric "
     "sync/tolerance, the start-up difference sync/probe_noise.")
    exact: bool = True
    ("Where the engines keep the synced bytes (CPU engines that load in place: colocated shared "
     "weights, disaggregated in-place buckets), check after each sync that they hold exactly the "
     "trainer's: both sides hash each (tensor, trainer rank) byte range (weight_sync.exact). "
     "sync/exact_ranges counts the ranges (0: not checked), sync/exact_seconds its time. The "
     "probe is checked either way.")
    checksum: str = "sum64"
    "Disaggregated: per-bucket checksum verified on arrival (sum64: fast, on device; crc32)."
    timeout_s: float = field(default=600.0, metadata={"bound": "> 0"})
    "Disaggregated: seconds a sync-group operation may wait for a peer before it fails."
    lora: str = "merged"
    ("With trainer.lora, what each sync moves: merged (base + adapter merged on the trainer "
     "side, synced as full weights: the engines run the model as without LoRA) or adapters (the "
     "adapter alone, loaded into the engines' vLLM LoRA as a new adapter per policy version, "
     "the old one removed: megabytes instead of the model, but on CPU vLLM runs LoRA models "
     "eagerly and through its LoRA kernels, slower; docs/lora.md).")


@dataclass
class RayConfig:
    address: Optional[str] = None
    "None: start a local Ray instance; 'auto' or host:port: join an existing cluster."
    num_workers: int = field(default=2, metadata={"bound": ">= 1"})
    "Trainer ranks (DeepSpeed); colocated, each also holds one rollout engine."
    num_cpus_per_worker: float = field(default=1.0, metadata={"bound": ">= 0"})
    "CPUs Ray reserves per trainer rank (colocated: per worker)."
    num_gpus_per_worker: float = field(default=0.0, metadata={"bound": ">= 0"})
    "GPUs Ray reserves per trainer rank (1.0 on a GPU cluster)."
    num_rollout_workers: int = field(default=2, metadata={"bound": ">= 0"})
    "Disaggregated: rollout engines (one vLLM each, in actors of their own)."
    num_cpus_per_rollout_worker: float = field(default=1.0, metadata={"bound": ">= 0"})
    "Disaggregated: CPUs Ray reserves per rollout engine."
    num_gpus_per_rollout_worker: float = field(default=0.0, metadata={"bound": ">= 0"})
    "Disaggregated: GPUs Ray reserves per rollout engine (1.0 on a GPU cluster)."
    trainer_resources: Dict[str, float] = field(default_factory=dict)
    ("Ray custom resources each trainer rank (colocated: each worker) asks for, e.g. "
     "{trainer_node: 1} with `ray start --resources '{\"trainer_node\": 2}'` on the nodes "
     "that should run them.")
    rollout_resources: Dict[str, float] = field(default_factory=dict)
    "Disaggregated: Ray custom resources each rollout engine asks for, e.g. {rollout_node: 1}."
    cpu_malloc: str = "auto"
    ("The memory allocator of CPU workers: auto (tcmalloc, preloaded, when libtcmalloc is "
     "installed, as vLLM's CPU backend recommends; docs/cpu-notes.md; scripts/setup.sh installs "
     "it), system, or the path of a malloc library to preload. Runs on GPUs keep the system "
     "allocator under auto.")
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
    max_staleness: int = field(default=1, metadata={"bound": ">= 0"})
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
    env: EnvConfig = field(default_factory=EnvConfig)
    placement: str = "colocated"
    "colocated: each worker holds a trainer rank and an engine; disaggregated: separate pools."
