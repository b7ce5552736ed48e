"""Policy losses, KL estimators and loss aggregation: pure functions on tensors.

Glossary of shapes: B samples in a micro-batch, T response tokens (padded).
Every function here is registered by the name a recipe uses; `lookup` turns an unknown name
into an error that lists the known ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from update.config import LossConfig


def lookup(registry: dict, name: str, what: str):
    """registry[name], or a ValueError that lists the valid names."""
    if name not in registry:
        known = ", ".join(sorted(registry))
        raise ValueError(f"{what} '{name}' is not registered; known: {known}")
    return registry[name]


def register(registry: dict, name: str):
    def wrap(fn):
        if name in registry:
            raise ValueError(f"'{name}' is registered twice; pick another name")
        registry[name] = fn
        return fn
    return wrap


# ---------------------------------------------------------------- aggregation
LOSS_AGGREGATIONS: dict[str, Callable] = {}


@register(LOSS_AGGREGATIONS, "token_mean")
def token_mean(loss_tok, response_mask, num_tokens: float, num_seqs: float):
    """Sum of token losses / tokens in the whole batch (DAPO's token-level loss).

    `num_tokens` counts the tokens of the global batch (all micro-batches and ranks), so the
    result summed over micro-batches is independent of how the batch was split.
    """
    return (loss_tok * response_mask).sum() / max(num_tokens, 1.0)


@register(LOSS_AGGREGATIONS, "seq_mean_token_mean")
def seq_mean_token_mean(loss_tok, response_mask, num_tokens: float, num_seqs: float):
    """Mean over sequences of each sequence's token mean (the original GRPO paper)."""
    per_seq = (loss_tok * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(num_seqs, 1.0)


# ---------------------------------------------------------------- KL
KL_ESTIMATORS: dict[str, Callable] = {}


@register(KL_ESTIMATORS, "k1")
def kl_k1(logprobs, ref_logprobs):
    """k1 = log pi - log pi_ref: unbiased, high variance, can be negative (Schulman 2020)."""
    return logprobs - ref_logprobs


@register(KL_ESTIMATORS, "k2")
def kl_k2(logprobs, ref_logprobs):
    """k2 = (log pi - log pi_ref)^2 / 2: biased, low variance, non-negative."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register(KL_ESTIMATORS, "k3")
def kl_k3(logprobs, ref_logprobs):
    """k3 = r - log r - 1 with r = pi_ref / pi: unbiased and non-negative (used by GRPO)."""
    log_r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # keep exp finite
    return torch.exp(log_r) - log_r - 1.0


# ---------------------------------------------------------------- policy losses
@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor  # [B, T] policy that generated / was current at rollout
    advantages: torch.Tensor  # [B, T] (a sequence advantage repeated over its tokens)
    response_mask: torch.Tensor  # [B, T] 1.0 on response tokens, 0.0 on padding
    num_tokens: float  # response tokens in the global batch
    num_seqs: float  # sequences in the global batch
    ref_logprobs: torch.Tensor | None = None  # [B, T] frozen reference, when kl_coef > 0


POLICY_LOSSES: dict[str, Callable] = {}


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(inputs: LossInputs, cfg: LossConfig):
    """PPO clipped surrogate with separate low/high clip (GRPO; DAPO when clip_high > clip_low).

    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = pi / pi_old,
    plus kl_coef * KL(pi || pi_ref) per token when a reference is given (GRPO's KL loss).
    Returns (loss, metrics) where loss is already aggregated with cfg.loss_agg.
    """
    mask = inputs.response_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    agg = lookup(LOSS_AGGREGATIONS, cfg.loss_agg, "loss aggregation")
    policy_loss = agg(loss_tok, mask, inputs.num_tokens, inputs.num_seqs)
    n = max(inputs.num_tokens, 1.0)
    metrics = {
        "loss/policy": policy_loss.detach(),
        "loss/clip_frac": ((clipped > unclipped).float() * mask).sum() / n,
        "loss/ratio_mean": (ratio.detach() * mask).sum() / n,
    }
    loss = policy_loss
    if inputs.ref_logprobs is not None and cfg.kl_coef > 0:
        kl_tok = lookup(KL_ESTIMATORS, cfg.kl_estimator, "KL estimator")(
            inputs.logprobs, inputs.ref_logprobs)
        kl = agg(kl_tok, mask, inputs.num_tokens, inputs.num_seqs)
        loss = loss + cfg.kl_coef * kl
        metrics["kl/mean"] = kl.detach()
    return loss, metrics


def policy_loss(inputs: LossInputs, cfg: LossConfig):
    """Dispatch to the policy loss named by cfg.policy_loss."""
    return lookup(POLICY_LOSSES, cfg.policy_loss, "policy loss")(inputs, cfg)


def nll_loss(logprobs, response_mask, num_tokens: float):
    """Supervised token NLL summed over the micro-batch / tokens of the global batch."""
    return -(logprobs * response_mask).sum() / max(num_tokens, 1.0)
