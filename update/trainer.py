"""A DeepSpeed (ZeRO-1/2/3) policy trainer: token logprobs, policy-loss steps, SFT steps.

Batches arrive as micro-batches of padded tensors (see `MicroBatch` keys below). Every loss is
normalized by the token/sequence count of the *global* batch, then multiplied by
world_size * grad_accum so that DeepSpeed's own averaging (over ranks and accumulation steps)
leaves exactly the global mean: the update does not depend on how the batch was split.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from update.config import LossConfig, TrainerConfig
from update.forward import (allow_recompute_with_cache, full_layout, is_shared, part_logprobs,
                            response_targets, shares_prompts, token_logprobs)
from update.losses import (BatchCounts, LossInputs, add_metrics, nll_loss, old_logprob_metrics,
                           policy_loss)
from update.mlp import lean_gated_mlps
from update.zero import (full_state_dict, gathered_weights, load_engine, save_engine, scoring,
                         zero_engine)

# MicroBatch keys (rl.algo.batch.collate): the tokens in one of two layouts (update.forward: full,
# or shared prompts); response-only token-level [B, R] float tensors: response_mask (1 on
# response tokens), advantages, old_logprobs, rollout_logprobs, and when used ref_logprobs,
# values, returns.


def _to(mb: dict, key: str, dev):
    return mb[key].to(dev) if mb.get(key) is not None else None


class PolicyTrainer:
    """The policy on a DeepSpeed engine, plus a frozen reference engine when KL is used.

    With `cfg.lora` the policy is the base model with LoRA adapters (update.lora): only they
    train and enter the optimizer and checkpoints, and the reference is the same module with
    the adapters switched off (no second model)."""

    peft = None  # the PeftModel handle of a LoRA policy
    _merged = None  # with LoRA: the merged model of the current weights, once a sync built it

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                 grad_accum: int, temperature: float = 1.0, norm_length: float = 1.0,
                 seed: int = 0):
        """`seed` draws the LoRA adapters' A, the same on every rank (rl-train: run.seed)."""
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        self.norm_length = norm_length
        self.world_size = dist.get_world_size()
        self.grad_accum = grad_accum
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model_path = model_path
        if cfg.lora is not None:
            from update.lora import add_adapters

            self.peft = add_adapters(model, cfg.lora, seed)  # in place: `model` holds the adapters
        lean_gated_mlps(model)  # one tensor fewer kept per MLP, the same numbers (update.mlp)
        if cfg.checkpointing():
            model.gradient_checkpointing_enable()
            allow_recompute_with_cache(model)  # shared prompts under recompute (update.forward)
            if self.peft is not None:  # a frozen embedding: checkpointed layers need a grad
                model.enable_input_require_grads()
        model.config.use_cache = False
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      weight_decay=cfg.weight_decay)
        self.engine = zero_engine(model, cfg, self.world_size, grad_accum, optimizer)
        self.ref = None
        # LoRA: the reference is the policy with its adapters off
        self.base_reference = loss_cfg.kl_coef > 0 and self.peft is not None
        if loss_cfg.kl_coef > 0 and self.peft is None:
            ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            ref_model.requires_grad_(False)
            self.ref = zero_engine(ref_model, cfg, self.world_size, grad_accum)
            self.ref.eval()
        self.share_prompts = shares_prompts(cfg, self.module.config, cfg.checkpointing())

    @property
    def module(self) -> torch.nn.Module:
        """The HF model (its parameters ZeRO-sharded under stage 3)."""
        return self.engine.module.model

    def _forward(self, engine, mb: dict, entropy: bool = False):
        """(token logprobs [B, R], entropy [B, R] or None) of the responses under `engine` (a
        DeepSpeed engine, or what `scoring` gives)."""
        from update.losses import entropy_from_logits

        if is_shared(mb) and not self.share_prompts:
            mb = full_layout(mb)
        targets, t = response_targets(mb), self.temperature

        def score(parts: list[torch.Tensor]) -> torch.Tensor:  # [B, R], or [2, B, R] with entropy
            logprobs = part_logprobs(parts, targets, t)
            if not entropy:
                return logprobs
            ent = torch.cat([entropy_from_logits(p / t) for p in parts], 1)
            return torch.stack([logprobs, ent])

        out = engine(mb=mb, score=score)
        return (out[0], out[1]) if entropy else (out, None)

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
        with scoring(self.engine) as policy:  # the reference only ever runs this forward
            for mb in micro_batches:
                item = {"old_logprobs": self._forward(policy, mb)[0].cpu()}
                ref = self._ref_logprobs(mb, policy)
                if ref is not None:
                    item["ref_logprobs"] = ref.cpu()
                out.append(item)
        return out

    @torch.no_grad()
    def _ref_logprobs(self, mb: dict, policy=None) -> torch.Tensor | None:
        """The reference's token logprobs of a micro-batch (None without a reference): the
        reference engine's, or with LoRA the policy's with its adapters off, run by `policy`
        (what `scoring` gives; opened here when None)."""
        if self.ref is not None:  # ZeRO-3: one gather of the whole frozen model, no hooks
            with scoring(self.ref) as ref:
                return self._forward(ref, mb)[0]
        if not self.base_reference:
            return None
        with ExitStack() as stack:
            if policy is None:
                policy = stack.enter_context(scoring(self.engine))
            stack.enter_context(self.peft.disable_adapter())
            module = self.engine.module  # the reference runs as the reference engine does:
            stack.callback(module.train, module.training)  # without dropout
            module.eval()
            return self._forward(policy, mb)[0]

    def train_step(self, micro_batches: list[dict], counts: BatchCounts) -> dict:
        """One optimizer step of the policy loss; metrics are this rank's share of global means.

        A micro-batch without `old_logprobs` takes them from this forward, detached (one pass:
        right when this is the only optimizer step on the batch, so the policy has not moved
        since the rollout); the reference then scores it here too, and the mismatch and KL
        metrics come from this forward.
        """
        self._check_accum(micro_batches)
        self._merged = None
        self.engine.train()
        counts = BatchCounts(counts.num_tokens, counts.num_seqs, self.norm_length)
        sums: dict[str, float] = {}
        for mb in micro_batches:
            dev = self.engine.device
            one_pass = "old_logprobs" not in mb
            ref = _to(mb, "ref_logprobs", dev)
            if ref is None:
                ref = self._ref_logprobs(mb)
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
        self._merged = None
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
        with scoring(self.engine) as policy:
            logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids),
                            use_cache=False).logits
        # raw (temperature 1), like vLLM's prompt logprobs
        return token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0].tolist()

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """DeepSpeed checkpoint (model, optimizer, LR state) in directory/tag; every rank calls.
        No `latest` file: the caller publishes a checkpoint once every part of it is written."""
        save_engine(self.engine, directory, tag, trained_only=self.peft is not None)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        self._merged = None
        load_engine(self.engine, directory, tag, trained_only=self.peft is not None)

    def full_state_dict(self) -> dict | None:
        """Unsharded weights on rank 0 (None elsewhere); a collective under ZeRO-3."""
        return full_state_dict(self.engine, self.cfg)

    def _whole(self, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter of the HF model (or its adapters only), whole, on every rank (one
        all-gather per dtype under ZeRO-3)."""
        from update.lora import is_adapter

        params = {n: p for n, p in self.module.named_parameters()
                  if not adapters_only or is_adapter(n)}
        if self.cfg.zero_stage == 3:
            return gathered_weights(params)
        return {n: p.detach() for n, p in params.items()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter tensors, whole, on every rank (a collective under ZeRO-3)."""
        return self._whole(adapters_only=True)

    def sync_module(self) -> torch.nn.Module:
        """The HF model a full-weight sync sends: the policy itself; with LoRA a plain model of
        the merged weights (W + scale * B @ A), built on every rank once per policy version, so
        that a sync and its byte check read the same tensors (a collective under ZeRO-3)."""
        if self.peft is None:
            return self.module
        if self._merged is None:
            from update.lora import merged, plain_model, scale

            self._merged = plain_model(self.module.config,
                                       merged(self._whole(), scale(self.cfg.lora)),
                                       dict(self.module.named_buffers()))
        return self._merged

    def release_merged(self) -> None:
        """Drop the merged model a sync built (LoRA, sync.lora=merged): a full copy per rank."""
        self._merged = None

    def save_hf(self, directory: str) -> None:
        """An HF model directory loadable by from_pretrained (weights only; rank 0 writes).
        With LoRA: `directory` is the adapter (loadable with peft, on the base model) and
        `directory`_merged the merged model."""
        import torch.distributed as dist

        if self.peft is not None:
            from update.lora import adapter_config, write_adapter

            adapter = self.adapter_weights()
            model = self.sync_module()
            if dist.get_rank() == 0:
                write_adapter(directory, adapter, adapter_config(self.cfg.lora, self.model_path))
                model.save_pretrained(f"{directory}_merged")
            return
        state = self.full_state_dict()
        if state is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.module.save_pretrained(directory, state_dict=state)
