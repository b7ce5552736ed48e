"""Typed configuration of the update side (DeepSpeed trainers and their losses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union


@dataclass
class LoraConfig:
    rank: int = field(default=8, metadata={"bound": ">= 1"})
    "Rank r of each adapter (A: r x in, B: out x r)."
    alpha: float = field(default=16.0, metadata={"bound": "> 0"})
    "Scale numerator: the adapter adds (alpha / rank) * B @ A to each target's weight."
    dropout: float = field(default=0.0, metadata={"bound": "in [0, 1)"})
    "Dropout on the adapters' input in training (0: none; rollouts never drop)."
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    ("Modules that get an adapter, as PEFT matches them: names or name suffixes (q_proj, "
     "v_proj, ...), or all-linear (every linear layer but the output head).")


@dataclass
class TrainerConfig:
    zero_stage: int = field(default=3, metadata={"bound": "in [0, 3]"})
    ("DeepSpeed ZeRO stage: 3 shards parameters, gradients and optimizer state over the ranks; "
     "2 gradients and optimizer state; 1 optimizer state; 0 nothing (every rank holds it all: "
     "DeepSpeed's plain data parallel, the fit for one worker; docs/cpu-notes.md).")
    zero3_persistence_threshold: int = field(default=0, metadata={"bound": ">= 0"})
    "ZeRO-3 keeps parameters below this many elements whole; 0 shards all (DeepSpeed's default is 1e5)."
    zero3_whole_model_max: int = field(default=5 * 10**7, metadata={"bound": ">= 0"})
    ("ZeRO-3 gathers a model (policy, critic, reference) whole for each forward and backward, "
     "one gather and no per-module hooks, when it has at most this many parameters or runs on "
     "one rank; a larger model on several ranks is gathered module by module. Whole holds a "
     "full copy of the weights during the step; 0: module by module always. The default is "
     "DeepSpeed's default prefetch bucket; the figures are in "
     "docs/benchmarks.md#zero-3-against-zero-2. The warm-up always gathers module by module, "
     "with DeepSpeed's defaults.")
    zero3_release_params: bool = True
    ("ZeRO-3, a model gathered module by module: release each module's weights once used, "
     "prefetch about one decoder layer and run the decoder layers' linears through DeepSpeed's "
     "ZeRO-3 linear (update.zero.zero3_linears), so that a step holds its shard and a layer or "
     "two gathered (docs/benchmarks.md#zero-3-against-zero-2). false: DeepSpeed's defaults, "
     "which keep a model under 1e9 parameters gathered from its forward into its backward.")
    lora: Optional[LoraConfig] = None
    ("Train LoRA adapters (PEFT) instead of the whole model: only they enter the optimizer and "
     "the checkpoints, the base stays frozen and is the reference policy (the adapter switched "
     "off: no second model). None: full fine-tuning.")
    dtype: str = "float32"
    "Training precision: float32 or bfloat16 (bf16 keeps fp32 master weights)."
    bf16_mode: str = "weights"
    ("How bfloat16 trains: weights (DeepSpeed bf16: bf16 weights and gradients, fp32 master "
     "copy in the optimizer) or autocast (fp32 weights, matmuls in bf16 under torch.autocast).")
    lr: float = field(default=1e-5, metadata={"bound": "> 0"})
    "AdamW learning rate of the policy."
    critic_lr: float = field(default=1e-4, metadata={"bound": "> 0"})
    "AdamW learning rate of the critic (PPO's value model)."
    weight_decay: float = field(default=0.0, metadata={"bound": ">= 0"})
    "AdamW weight decay."
    beta1: float = field(default=0.9, metadata={"bound": "in [0, 1)"})
    "AdamW beta1."
    beta2: float = field(default=0.999, metadata={"bound": "in [0, 1)"})
    "AdamW beta2."
    grad_clip: float = field(default=1.0, metadata={"bound": ">= 0"})
    "Global gradient-norm clip; 0 turns it off."
    micro_batch_size: int = field(default=8, metadata={"bound": ">= 1"})
    "Samples per forward/backward on one rank; gradient accumulation covers the rest."
    gradient_checkpointing: Union[bool, str] = "auto"
    ("Recompute activations in the backward (less memory, about a third more update time): true, "
     "false, or auto: rl-train recomputes only when its plan says a micro-batch's activations "
     "would not fit beside the rest of the memory, and prints which it chose and why "
     "(docs/planning.md#gradient-checkpointing-auto); the update package alone reads auto as "
     "false.")
    enable_prompt_sharing: bool = True
    ("Run each distinct prompt of a micro-batch once and its responses on its keys and values "
     "(update.forward: the same logits, less work when rollout.n > 1), with or without "
     "recompute; checked at start-up on a small copy of the architecture.")
    total_steps: int = field(default=20, metadata={"bound": ">= 1"})
    "RL steps (one rollout batch and its update each)."
    checkpoint_every: int = field(default=0, metadata={"bound": ">= 0"})
    "Save a checkpoint (rl-train --resume continues from it) every N steps; 0 saves none."
    keep_checkpoints: int = field(default=0, metadata={"bound": ">= 0"})
    "Keep only the newest N checkpoints; 0 keeps all."
    max_restarts: int = field(default=0, metadata={"bound": ">= 0"})
    ("When an actor dies (killed, out of memory): restart the placement from the latest "
     "checkpoint up to N times; 0 stops the run with the command that resumes it.")
    eval_every: int = field(default=0, metadata={"bound": ">= 0"})
    ("Held-out evaluation (data.eval_path or data.eval_fraction) every N RL steps; with a "
     "held-out set the run always evaluates before step 1 and after the last; 0: only those two.")
    eval_k: int = field(default=8, metadata={"bound": ">= 0"})
    ("Held-out evaluation: samples per prompt at rollout.temperature for pass@k (besides the "
     "greedy one); 0: greedy only.")
    eval_threshold: float = field(default=1.0, metadata={"bound": "any"})
    ("Held-out evaluation: a response counts as correct when its reward reaches this (1.0: a "
     "verifier's full marks, e.g. exact_answer).")

    def checkpointing(self) -> bool:
        """gradient_checkpointing as a bool (auto: rl-train resolves it before the trainers
        start; unresolved, it is false)."""
        return self.gradient_checkpointing is True


@dataclass
class LossConfig:
    policy_loss: str = "ppo_clip"
    "Policy loss registered in update.losses.POLICY_LOSSES (ppo_clip, gspo, pg)."
    clip_low: float = field(default=0.2, metadata={"bound": "in [0, 1)"})
    "Lower clip range of the importance ratio (1 - clip_low)."
    clip_high: float = field(default=0.2, metadata={"bound": ">= 0"})
    "Upper clip range (1 + clip_high); DAPO's clip-higher raises it to 0.28."
    clip_ratio_c: float = field(default=0.0, metadata={"bound": "> 1 or 0"})
    "Dual-clip bound for negative advantages (Ye et al. 2020; 3.0 is usual); 0 turns it off."
    loss_agg: str = "token_mean"
    "Aggregation registered in update.losses.LOSS_AGGREGATIONS."
    kl_coef: float = field(default=0.0, metadata={"bound": ">= 0"})
    "Weight of KL(policy || reference); 0 skips the reference model entirely."
    kl_estimator: str = "k3"
    "KL estimator registered in update.losses.KL_ESTIMATORS (k1, k2, k3)."
    use_kl_loss: bool = True
    "True: KL is a loss term (GRPO); False: a per-token reward penalty (PPO, REINFORCE++)."
    entropy_coef: float = field(default=0.0, metadata={"bound": ">= 0"})
    "Weight of the entropy bonus (subtracted from the loss)."
    tis_cap: float = field(default=2.0, metadata={"bound": ">= 0"})
    "Cap of the off-policy correction's weight pi_trainer / pi_rollout (see correction); 0 = off."
    correction: str = "tis"
    ("Off-policy correction in update.losses.CORRECTIONS, between the behavior policy (the "
     "engine's logprob of each token) and the proximal one (the trainer's at the update's start): "
     "tis (ratio to proximal, weight min(proximal/behavior, tis_cap)), decoupled (ratio to "
     "proximal, weight proximal/behavior, tokens above tis_cap dropped: decoupled PPO as AReaL), "
     "none (ratio and clip to the behavior policy, no weight).")
    value_clip: float = field(default=0.2, metadata={"bound": "> 0"})
    "PPO critic: clip range of new values around the old ones."
