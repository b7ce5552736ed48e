"""GRPO advantages with hand-worked values, and the vectorized code against a plain loop."""
import math

import pytest
import torch

from rl.advantages import compute_advantages
from rl.config import AlgorithmConfig


def test_grpo_hand_worked():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # -> advantages +-0.5 / 0.57735 = +-0.866025; a group of equal rewards gets 0
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = compute_advantages(r, AlgorithmConfig(advantage="grpo"))
    assert a[0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_dr_grpo_no_std():
    # Dr.GRPO: centring only; group [2, 0]: mean 1 -> [1, -1]
    a = compute_advantages(torch.tensor([[2.0, 0.0]]),
                           AlgorithmConfig(advantage="grpo", norm_by_std=False))
    assert a.tolist() == [[1.0, -1.0]]


def test_grpo_matches_a_plain_loop():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(7, 5, generator=g, dtype=torch.float64)
    a = compute_advantages(r, AlgorithmConfig())
    for p in range(7):
        group = r[p].tolist()
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        for i, x in enumerate(group):
            assert a[p, i].item() == pytest.approx((x - mean) / (std + 1e-6))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="advantage estimator 'x' is not registered; known: grpo"):
        compute_advantages(torch.zeros(1, 2), AlgorithmConfig(advantage="x"))
