"""Advantage estimators: pure functions on tensors, registered by the name a recipe uses.

Glossary: B samples (groups of G consecutive samples share a prompt; G = rollout.n),
T response tokens (padded). One signature for all:
`fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> (advantages [B, T], returns [B, T])`.
Outcome estimators give every token of a sample its sequence advantage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rl.schema import AlgorithmConfig
from update.losses import lookup, register

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


@dataclass
class AdvantageInputs:
    scores: torch.Tensor  # [B] sequence rewards
    response_mask: torch.Tensor  # [B, T]
    group_size: int  # G
    token_rewards: torch.Tensor | None = None  # [B, T] e.g. -kl_coef * KL_t (KL in reward)
    values: torch.Tensor | None = None  # [B, T] critic values (gae)


def _grouped(scores: torch.Tensor, g: int) -> torch.Tensor:
    if scores.numel() % g:
        raise ValueError(f"{scores.numel()} scores do not form groups of {g}")
    return scores.view(-1, g)  # [B/G, G]


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor):
    adv = seq_adv.view(-1, 1) * mask
    return adv, adv


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole batch."""
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


def last_token_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """[B, T]: each sample's score on its last response token, plus any per-token rewards."""
    mask = inputs.response_mask
    rewards = torch.zeros_like(mask) if inputs.token_rewards is None else \
        inputs.token_rewards * mask
    # the last model token (environment tokens of a multi-turn response are 0 in the mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, 0).amax(-1)
    return rewards.scatter_add(1, last.view(-1, 1), inputs.scores.view(-1, 1).to(mask.dtype))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float):
    """G_t = sum_{s >= t} gamma^(s-t) r_s over the model's tokens of the response (s and t
    count model tokens: the environment's, mask 0, are stepped over): [B, T] -> [B, T]."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        out[:, t] = running
    return out * mask


@register(ADVANTAGE_ESTIMATORS, "grpo")
def grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """GRPO (Shao et al. 2024): A_i = (r_i - mean(group)) / (std(group) + eps).

    std is the unbiased sample std, as in the paper's code. cfg.norm_by_std=False gives
    Dr.GRPO's centring only. A group whose rewards are all equal gets zero advantages.
    """
    r = _grouped(inputs.scores, inputs.group_size)
    adv = r - r.mean(-1, keepdim=True)
    if cfg.norm_by_std:
        adv = adv / (r.std(-1, keepdim=True) + cfg.eps)
    return _broadcast(adv, inputs.response_mask)


@register(ADVANTAGE_ESTIMATORS, "dr_grpo")
def dr_grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """Dr.GRPO (Liu et al. 2025): A_i = r_i - mean(group), no std division (no difficulty bias)."""
    r = _grouped(inputs.scores, inputs.group_size)
    return _broadcast(r - r.mean(-1, keepdim=True), inputs.response_mask)


@register(ADVANTAGE_ESTIMATORS, "rloo")
def rloo(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean)."""
    r = _grouped(inputs.scores, inputs.group_size)
    g = r.shape[-1]
    return _broadcast((r - r.mean(-1, keepdim=True)) * g / (g - 1), inputs.response_mask)


@register(ADVANTAGE_ESTIMATORS, "reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """REINFORCE++ (Hu 2025): token returns of score + per-token KL penalty, whitened over the
    batch. With cfg.reinforce_pp_group_baseline the group mean score is subtracted first
    (REINFORCE++-baseline)."""
    scores = inputs.scores
    if cfg.reinforce_pp_group_baseline:
        r = _grouped(scores, inputs.group_size)
        scores = (r - r.mean(-1, keepdim=True)).view(-1)
    shifted = AdvantageInputs(scores, inputs.response_mask, inputs.group_size,
                              inputs.token_rewards)
    returns = discounted_returns(last_token_rewards(shifted), inputs.response_mask, cfg.gamma)
    return whiten(returns, inputs.response_mask), returns


@register(ADVANTAGE_ESTIMATORS, "gae")
def gae(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """GAE (Schulman et al. 2016) for PPO with a critic.

    delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last token);
    A_t = delta_t + gamma lambda A_{t+1}; returns = A + V; advantages whitened over the batch.
    t runs over the model's tokens: t+1 is the next one the model sampled, past any
    environment tokens of a multi-turn response between them (mask 0, no advantage).
    """
    if inputs.values is None:
        raise ValueError("advantage 'gae' needs critic values: use it with a critic "
                         "(algorithm.critic: true)")
    mask = inputs.response_mask
    rewards, values = last_token_rewards(inputs), inputs.values * mask
    adv = torch.zeros_like(rewards)
    running, next_value = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        here = delta + cfg.gamma * cfg.lam * running
        adv[:, t] = m * here
        running = m * here + (1 - m) * running  # carried over environment tokens and pads
        next_value = m * values[:, t] + (1 - m) * next_value
    returns = (adv + values) * mask
    return whiten(adv, mask), returns


def compute_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig):
    """Dispatch to the estimator named by cfg.advantage: -> (advantages, returns), each [B, T]."""
    return lookup(ADVANTAGE_ESTIMATORS, cfg.advantage, "advantage estimator")(inputs, cfg)
