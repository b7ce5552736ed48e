"""Advantage estimators: pure functions on tensors, registered by the name a recipe uses.

Glossary: P prompts, G samples per prompt (the group, rollout.n).
"""
from __future__ import annotations

from typing import Callable

import torch

from rl.config import AlgorithmConfig
from update.losses import lookup, register

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


@register(ADVANTAGE_ESTIMATORS, "grpo")
def grpo_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig, eps: float = 1e-6):
    """GRPO (Shao et al. 2024): A_i = (r_i - mean(group)) / (std(group) + eps).

    rewards [P, G] -> advantages [P, G]. std is the unbiased sample std, as in the paper's code;
    with cfg.norm_by_std=False it is Dr.GRPO's (Liu et al. 2025) mean-centring only. A group whose
    rewards are all equal gets zero advantages (no signal).
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not cfg.norm_by_std:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)


def compute_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """Dispatch to the estimator named by cfg.advantage; rewards [P, G] -> [P, G]."""
    return lookup(ADVANTAGE_ESTIMATORS, cfg.advantage, "advantage estimator")(rewards, cfg)
