"""A DeepSpeed (ZeRO-1/2/3) policy trainer: token logprobs, policy-loss steps, SFT steps.

Batches arrive as micro-batches of padded tensors (see `MicroBatch` keys below). Every loss is
normalized by the token/sequence count of the *global* batch, then multiplied by
world_size * grad_accum so that DeepSpeed's own averaging (over ranks and accumulation steps)
leaves exactly the global mean: the update does not depend on how the batch was split.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from update.config import LossConfig, TrainerConfig
from update.forward import (check_model_class, full_layout, is_shared, response_logits,
                            response_targets, token_logprobs)
from update.losses import (BatchCounts, LossInputs, add_metrics, nll_loss, old_logprob_metrics,
                           policy_loss)

# MicroBatch keys (rl.algo.batch.collate): the tokens in one of two layouts (update.forward: full,
# or shared prompts); response-only token-level [B, R] float tensors: response_mask (1 on
# response tokens), advantages, old_logprobs, rollout_logprobs, and when used ref_logprobs,
# values, returns.

# Largest |shared-prompt - full| logprob of the start-up check (float32) for the shared layout
# to be used: measured 0-2.5e-5 on Qwen2/Llama; a forward that mishandles the cache is off by
# whole nats.
SHARED_PROMPT_TOLERANCE = 1e-4


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer's process group (gloo on CPU, NCCL on GPU)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device_name() == "cuda" else "gloo")


def ds_config(cfg: TrainerConfig, world_size: int, grad_accum: int, train: bool = True) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.micro_batch_size * grad_accum * world_size,
        "zero_optimization": {
            # ZeRO-1/2 shard optimizer state and gradients, which a frozen model (the reference)
            # has none of: DeepSpeed refuses those stages without an optimizer
            "stage": cfg.zero_stage if train or cfg.zero_stage == 3 else 0,
            # 0: shard every parameter, even tiny ones (DeepSpeed's default keeps < 1e5 whole).
            "stage3_param_persistence_threshold": cfg.zero3_persistence_threshold,
            # ZeRO-3's own linear (on by default) replaces torch.nn.functional.linear process-wide
            # and computes x @ W.t() with matmul: for the strided hidden states that
            # logits_to_keep slices it falls back to a batched matmul that copies the weight once
            # per sample (on the 49k-vocabulary head of SmolLM2, over half the step on CPU)
            "memory_efficient_linear": False,
        },
        "bf16": {"enabled": cfg.dtype == "bfloat16" and cfg.bf16_mode == "weights"},
        "torch_autocast": {"enabled": cfg.dtype == "bfloat16" and cfg.bf16_mode == "autocast",
                           "dtype": "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train:
        config["gradient_clipping"] = cfg.grad_clip
        config["zero_allow_untested_optimizer"] = True  # a client torch AdamW: no JIT op build
    return config


def save_engine(engine, directory: str, tag: str) -> None:
    engine.save_checkpoint(directory, tag=tag, save_latest=False)


def load_engine(engine, directory: str, tag: str) -> None:
    """Weights, optimizer and LR state exactly as saved (a resumed step is bit-identical)."""
    path, _ = engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True, load_module_strict=True)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {directory}/{tag}")


def _to(mb: dict, key: str, dev):
    return mb[key].to(dev) if mb.get(key) is not None else None


class PolicyTrainer:
    """The policy on a DeepSpeed engine, plus a frozen reference engine when KL is used."""

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                 grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0):
        import deepspeed
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        self.norm_length = norm_length
        self.world_size = dist.get_world_size()
        self.grad_accum = grad_accum
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      weight_decay=cfg.weight_decay)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config(cfg, self.world_size, grad_accum))
        self.ref = None
        if loss_cfg.kl_coef > 0:
            ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            ref_model.requires_grad_(False)
            self.ref, *_ = deepspeed.initialize(
                model=ref_model, config=ds_config(cfg, self.world_size, grad_accum, train=False))
            self.ref.eval()
        self.share_prompts = self._can_share_prompts()

    def _can_share_prompts(self) -> bool:
        """Whether shared-prompt micro-batches run as such (else they are expanded to the full
        layout): on when configured and a small float32 model of this architecture scores a
        made-up batch alike both ways (update.forward.check_model_class; every rank decides
        alike, from the same config)."""
        import logging

        if not self.cfg.enable_prompt_sharing:
            return False
        if self.cfg.gradient_checkpointing:  # HF turns the cache off under checkpointing
            return False
        diff, error = check_model_class(self.module.config)
        if diff <= SHARED_PROMPT_TOLERANCE:
            return True
        logging.getLogger(__name__).warning(
            "trainer.enable_prompt_sharing: %s scores shared prompts %s, so each sample runs "
            "its own prompt (slower when n > 1)", type(self.module).__name__,
            f"with an error ({error})" if error else f"off by {diff:.3g} nats")
        return False

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _forward(self, engine, mb: dict, entropy: bool = False):
        """(token logprobs [B, R], entropy [B, R] or None) of the responses under `engine`."""
        from update.losses import entropy_from_logits

        if is_shared(mb) and not self.share_prompts:
            mb = full_layout(mb)
        logits = response_logits(engine, mb)  # [B, R, V]
        logprobs = token_logprobs(logits, response_targets(mb).to(engine.device),
                                  self.temperature)
        ent = entropy_from_logits(logits / self.temperature) if entropy else None
        return logprobs, ent

    def _check_accum(self, micro_batches: list[dict]) -> None:
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"got {len(micro_batches)} micro-batches, the engine was built for "
                             f"{self.grad_accum} per optimizer step; split batches the same way")

    @torch.no_grad()
    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        """Before the update: old logprobs of the policy (and the reference's), per micro-batch.

        Computed once per rollout batch, so every epoch and mini-batch uses the same old policy.
        """
        self.engine.eval()
        out = []
        for mb in micro_batches:
            item = {"old_logprobs": self._forward(self.engine, mb)[0].cpu()}
            if self.ref is not None:
                item["ref_logprobs"] = self._forward(self.ref, mb)[0].cpu()
            out.append(item)
        return out

    def train_step(self, micro_batches: list[dict], counts: BatchCounts) -> dict:
        """One optimizer step of the policy loss; metrics are this rank's share of global means.

        A micro-batch without `old_logprobs` takes them from this forward, detached (one pass:
        right when this is the only optimizer step on the batch, so the policy has not moved
        since the rollout); the reference then scores it here too, and the mismatch and KL
        metrics come from this forward.
        """
        self._check_accum(micro_batches)
        self.engine.train()
        counts = BatchCounts(counts.num_tokens, counts.num_seqs, self.norm_length)
        sums: dict[str, float] = {}
        for mb in micro_batches:
            dev = self.engine.device
            one_pass = "old_logprobs" not in mb
            ref = _to(mb, "ref_logprobs", dev)
            if ref is None and self.ref is not None:
                with torch.no_grad():
                    ref = self._forward(self.ref, mb)[0]
            grad_entropy = self.loss_cfg.entropy_coef > 0
            with torch.set_grad_enabled(True):
                logprobs, ent = self._forward(self.engine, mb, entropy=grad_entropy)
            if not grad_entropy:  # the metric only: no graph through the entropy
                ent = None
            old = logprobs.detach() if one_pass else mb["old_logprobs"].to(dev)
            mask, rollout = mb["response_mask"].to(dev), _to(mb, "rollout_logprobs", dev)
            inputs = LossInputs(
                logprobs=logprobs, old_logprobs=old, advantages=mb["advantages"].to(dev),
                response_mask=mask, counts=counts, ref_logprobs=ref, rollout_logprobs=rollout,
                entropy=ent)
            loss, metrics = policy_loss(inputs, self.loss_cfg)
            self.engine.backward(loss * self.world_size * self.grad_accum)
            self.engine.step()
            add_metrics(sums, {k: float(v) for k, v in metrics.items()})
            if one_pass and rollout is not None:
                add_metrics(sums, old_logprob_metrics(old, rollout, ref, mask, counts,
                                                      self.loss_cfg.kl_estimator))
        sums["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
        return sums

    def sft_step(self, micro_batches: list[dict], num_tokens: float) -> dict:
        """One optimizer step of supervised NLL on the response tokens (the warm-up)."""
        self._check_accum(micro_batches)
        self.engine.train()
        total = 0.0
        for mb in micro_batches:
            logprobs, _ = self._forward(self.engine, mb)
            loss = nll_loss(logprobs, mb["response_mask"].to(logprobs.device), num_tokens)
            self.engine.backward(loss * self.world_size * self.grad_accum)
            self.engine.step()
            total += loss.item()
        return {"loss/sft": total}

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first (a collective under ZeRO-3: every rank calls)."""
        self.engine.eval()
        ids = torch.tensor([token_ids]).to(self.engine.device)
        logits = self.engine(input_ids=ids, attention_mask=torch.ones_like(ids),
                             use_cache=False).logits
        # raw (temperature 1), like vLLM's prompt logprobs
        return token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0].tolist()

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """DeepSpeed checkpoint (model, optimizer, LR state) in directory/tag; every rank calls.
        No `latest` file: the caller publishes a checkpoint once every part of it is written."""
        save_engine(self.engine, directory, tag)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        load_engine(self.engine, directory, tag)

    def full_state_dict(self) -> dict | None:
        """Unsharded weights on rank 0 (None elsewhere); a collective under ZeRO-3."""
        return full_state_dict(self.engine, self.cfg)

    def save_hf(self, directory: str) -> None:
        """An HF model directory loadable by from_pretrained (weights only; rank 0 writes)."""
        state = self.full_state_dict()
        if state is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.module.save_pretrained(directory, state_dict=state)


def full_state_dict(engine, cfg: TrainerConfig) -> dict | None:
    """Unsharded weights of a DeepSpeed engine on rank 0 (None elsewhere); a collective."""
    import torch.distributed as dist

    if cfg.zero_stage == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if dist.get_rank() == 0 else None
