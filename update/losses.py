"""Policy losses, value loss, KL estimators and loss aggregation: pure functions on tensors.

Glossary of shapes: B samples in a micro-batch, T token positions (padded).
Every function here is registered by the name a recipe uses; `lookup` turns an unknown name
into an error that lists the known ones. Per-token policy losses share one signature,
`fn(inputs: LossInputs, cfg: LossConfig) -> (loss_tok [B, T], metrics)`; `policy_loss` adds the
truncated-IS weights, aggregation, KL and entropy terms around them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


# ---------------------------------------------------------------- aggregation
LOSS_AGGREGATIONS: dict[str, Callable] = {}
# Every aggregation takes (loss_tok [B, T], mask [B, T], counts) where counts describe the
# *global* batch (all micro-batches and ranks), so summing the pieces' results gives the loss of
# the whole batch: the update does not depend on how the batch was split.


@dataclass
class BatchCounts:
    num_tokens: float  # response tokens in the global batch
    num_seqs: float  # sequences in the global batch
    norm_length: float = 1.0  # Dr.GRPO's constant per-sequence normalizer (max response length)


@register(LOSS_AGGREGATIONS, "token_mean")
def token_mean(loss_tok, mask, counts: BatchCounts):
    """Sum of token losses / tokens in the batch (DAPO's token-level loss)."""
    return masked_sum(loss_tok, mask) / max(counts.num_tokens, 1.0)


@register(LOSS_AGGREGATIONS, "seq_mean_token_mean")
def seq_mean_token_mean(loss_tok, mask, counts: BatchCounts):
    """Mean over sequences of each sequence's token mean (the original GRPO paper)."""
    per_seq = (loss_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(counts.num_seqs, 1.0)


@register(LOSS_AGGREGATIONS, "seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss_tok, mask, counts: BatchCounts):
    """Dr.GRPO (Liu et al. 2025): token sums / a constant length, averaged over sequences.

    No per-sequence length division, so long wrong answers are not favoured.
    """
    return masked_sum(loss_tok, mask) / max(counts.norm_length, 1.0) / max(counts.num_seqs, 1.0)


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


def kl(logprobs, ref_logprobs, estimator: str):
    return lookup(KL_ESTIMATORS, estimator, "KL estimator")(logprobs, ref_logprobs)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical over the last dim: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------- policy losses
@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor  # [B, T] trainer logprobs before this update (no grad)
    advantages: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] 1.0 on response tokens, 0.0 elsewhere
    counts: BatchCounts
    ref_logprobs: torch.Tensor | None = None  # [B, T] frozen reference, for the KL loss
    rollout_logprobs: torch.Tensor | None = None  # [B, T] from the rollout engine, for TIS
    entropy: torch.Tensor | None = None  # [B, T] policy entropy, for the bonus


POLICY_LOSSES: dict[str, Callable] = {}


def _clipped_surrogate(ratio, advantages, cfg: LossConfig):
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip(inputs: LossInputs, cfg: LossConfig):
    """PPO clipped surrogate with separate low/high clip (GRPO; DAPO's clip-higher).

    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = pi / pi_old.
    With clip_ratio_c > 0, dual-clip (Ye et al. 2020): for A_t < 0 the loss is capped at
    -A_t * clip_ratio_c, so a huge ratio on a bad token cannot blow up the update.
    """
    ratio = torch.exp((inputs.logprobs - inputs.old_logprobs).clamp(-20.0, 20.0))
    loss, clipped = _clipped_surrogate(ratio, inputs.advantages, cfg)
    if cfg.clip_ratio_c > 0:
        capped = torch.minimum(loss, -inputs.advantages * cfg.clip_ratio_c)
        dual = (inputs.advantages < 0) & (capped < loss)
        loss = torch.where(inputs.advantages < 0, capped, loss)
        clipped = torch.maximum(clipped, dual.float())
    return loss, {"ratio": ratio.detach(), "clipped": clipped}


@register(POLICY_LOSSES, "gspo")
def gspo(inputs: LossInputs, cfg: LossConfig):
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, clipped at sequence level.

    s_i = exp(mean_t(log pi - log pi_old)) over the response; the token form
    s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)) has the same value and the paper's gradient.
    Use with small clip ranges (the paper: 3e-4 / 4e-4) and seq_mean_token_mean.
    """
    mask = inputs.response_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    token_log_ratio = seq_log_ratio.detach() + inputs.logprobs - inputs.logprobs.detach()
    ratio = torch.exp(token_log_ratio.clamp(-20.0, 20.0))
    loss, clipped = _clipped_surrogate(ratio, inputs.advantages, cfg)
    return loss, {"ratio": ratio.detach(), "clipped": clipped}


@register(POLICY_LOSSES, "pg")
def vanilla_pg(inputs: LossInputs, cfg: LossConfig):
    """Plain policy gradient (REINFORCE): loss_t = -A_t log pi(y_t); no ratio, no clip."""
    ratio = torch.exp((inputs.logprobs - inputs.old_logprobs).detach())
    return -inputs.advantages * inputs.logprobs, {"ratio": ratio,
                                                  "clipped": torch.zeros_like(ratio)}


def tis_weights(old_logprobs, rollout_logprobs, cap: float):
    """Truncated IS (Yao et al. 2025): min(pi_trainer / pi_rollout, cap), no gradient.

    Corrects the mismatch between the rollout engine's and the trainer's token probabilities.
    """
    return torch.exp((old_logprobs - rollout_logprobs).clamp(max=20.0)).clamp(max=cap).detach()


# ---------------------------------------------------------------- off-policy corrections
CORRECTIONS: dict[str, Callable] = {}
# Every correction takes (old_logprobs [B, T]: the trainer's at the version the update starts
# from, i.e. the proximal policy; rollout_logprobs [B, T]: the behavior policy's, the engine's
# logprob of each token under the version that produced it; cap) and returns a Correction: the
# logprobs the policy loss takes its ratio (and clip) to, per-token weights of the policy loss,
# and per-token weights of the KL loss (None: unweighted), all without gradient.


@dataclass
class Correction:
    ratio_to: torch.Tensor  # [B, T] the "old" logprobs of the policy loss's ratio
    weights: torch.Tensor | None  # [B, T] multiply the policy loss per token
    kl_weights: torch.Tensor | None  # [B, T] multiply the KL loss per token


def _capped_ratio(old_logprobs, rollout_logprobs, cap: float):
    """proximal / behavior per token, 0 where it exceeds the cap (no gradient)."""
    ratio = torch.exp((old_logprobs - rollout_logprobs).clamp(max=20.0)).detach()
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


@register(CORRECTIONS, "tis")
def correction_tis(old_logprobs, rollout_logprobs, cap: float) -> Correction:
    """Truncated IS: ratio to the proximal policy, weight min(pi_prox / pi_behavior, cap); a
    larger ratio is cut to the cap. Meant for the engine/trainer mismatch of one version (the
    sync pipeline), so the KL loss is not weighted."""
    return Correction(old_logprobs, tis_weights(old_logprobs, rollout_logprobs, cap), None)


@register(CORRECTIONS, "decoupled")
def correction_decoupled(old_logprobs, rollout_logprobs, cap: float) -> Correction:
    """Decoupled PPO (Hilton et al. 2022; AReaL's behav_imp_weight_cap): ratio and clip to the
    proximal policy, weight pi_prox / pi_behavior, and drop the tokens whose weight exceeds the
    cap (weight 0) instead of cutting it: a token the behavior policy made far likelier than the
    proximal one carries no signal the update can trust. The KL loss takes the same weights:
    the current policy's KL to the reference, estimated from behavior samples (unweighted, a
    stale token the policy has since made unlikely gets a k3 of exp(ref - logp), which blew up
    async runs). With behavior = proximal every weight is 1, the same as tis."""
    weights = _capped_ratio(old_logprobs, rollout_logprobs, cap)
    return Correction(old_logprobs, weights, weights)


@register(CORRECTIONS, "none")
def correction_none(old_logprobs, rollout_logprobs, cap: float) -> Correction:
    """No weight: the behavior policy is the old policy, so the ratio and its clip are to the
    engine's logprobs (plain PPO on the samples as generated; AReaL without recomputation). A
    token that an update since its generation already moved by more than the clip range in its
    advantage's direction gets no more push. The KL loss is weighted as in decoupled."""
    return Correction(rollout_logprobs, None, _capped_ratio(old_logprobs, rollout_logprobs, cap))


def policy_loss(inputs: LossInputs, cfg: LossConfig):
    """The full actor loss: policy term (x the off-policy correction's weights), + KL loss,
    - entropy bonus.

    Returns (loss, metrics); metrics are this piece's share of global means, so summing them
    over micro-batches and ranks gives the batch value.
    """
    mask, counts = inputs.response_mask, inputs.counts
    agg = lookup(LOSS_AGGREGATIONS, cfg.loss_agg, "loss aggregation")
    correct = lookup(CORRECTIONS, cfg.correction, "off-policy correction")
    fix = None
    if cfg.tis_cap > 0 and inputs.rollout_logprobs is not None:
        fix = correct(inputs.old_logprobs, inputs.rollout_logprobs, cfg.tis_cap)
        inputs = replace(inputs, old_logprobs=fix.ratio_to)
    loss_tok, parts = lookup(POLICY_LOSSES, cfg.policy_loss, "policy loss")(inputs, cfg)
    n = max(counts.num_tokens, 1.0)
    metrics = {"loss/clip_frac": masked_sum(parts["clipped"], mask) / n,
               "loss/ratio_mean": masked_sum(parts["ratio"], mask) / n}
    if fix is not None and fix.weights is not None:
        loss_tok = loss_tok * fix.weights
        metrics["mismatch/tis_weight_mean"] = masked_sum(fix.weights, mask) / n
    if fix is not None and cfg.correction == "decoupled":
        metrics["mismatch/dropped_tokens"] = masked_sum((fix.weights == 0).float(), mask) / n
    loss = agg(loss_tok, mask, counts)
    metrics["loss/policy"] = loss.detach()
    if inputs.ref_logprobs is not None and cfg.kl_coef > 0 and cfg.use_kl_loss:
        kl_tok = kl(inputs.logprobs, inputs.ref_logprobs, cfg.kl_estimator)
        if fix is not None and fix.kl_weights is not None:
            kl_tok = kl_tok * fix.kl_weights
        kl_value = agg(kl_tok, mask, counts)
        loss = loss + cfg.kl_coef * kl_value
        metrics["loss/kl"] = kl_value.detach()
    if inputs.entropy is not None:
        entropy = agg(inputs.entropy, mask, counts)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy
        metrics["entropy/mean"] = entropy.detach()
    return loss, metrics


MAX_METRICS = ("mismatch/max_abs_diff",)  # reduced over micro-batches and ranks by max, not sum


def old_logprob_metrics(old_logprobs, rollout_logprobs, ref_logprobs, mask, counts: BatchCounts,
                        kl_estimator: str) -> dict:
    """Before the update: the rollout engine vs trainer mismatch (k3 KL, largest |diff|), and the
    KL to the reference (kl/mean), as this piece's share of global token means ([B, T] each)."""
    n = max(counts.num_tokens, 1.0)
    metrics = {"mismatch/kl": float(masked_sum(kl_k3(rollout_logprobs, old_logprobs), mask) / n),
               "mismatch/max_abs_diff": float(((old_logprobs - rollout_logprobs).abs() * mask)
                                              .max()) if mask.numel() else 0.0}
    if ref_logprobs is not None:
        metrics["kl/mean"] = float(masked_sum(kl(old_logprobs, ref_logprobs, kl_estimator),
                                              mask) / n)
    return metrics


def add_metrics(total: dict, more: dict) -> dict:
    """Accumulate shares of global means (sum), and MAX_METRICS by max."""
    for k, v in more.items():
        total[k] = max(total[k], v) if k in MAX_METRICS and k in total else total.get(k, 0.0) + v
    return total


def value_loss(values, old_values, returns, mask, clip: float, counts: BatchCounts):
    """PPO clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2).

    Token mean over the global batch. Returns (loss, metrics).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss_tok = 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())
    n = max(counts.num_tokens, 1.0)
    loss = masked_sum(loss_tok, mask) / n
    return loss, {"loss/value": loss.detach(),
                  "values/mean": masked_sum(values.detach(), mask) / n,
                  "values/clip_frac": masked_sum(
                      ((values - returns).square() < (clipped - returns).square()).float(),
                      mask) / n}


def nll_loss(logprobs, response_mask, num_tokens: float):
    """Supervised token NLL summed over the micro-batch / tokens of the global batch."""
    return -(logprobs * response_mask).sum() / max(num_tokens, 1.0)
