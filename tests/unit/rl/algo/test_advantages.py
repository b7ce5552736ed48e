"""Advantage estimators with hand-worked values, and vectorized code against plain loops."""
import math

import pytest
import torch

from rl.algo.advantages import AdvantageInputs, compute_advantages, discounted_returns
from rl.schema import AlgorithmConfig


def adv(scores, lengths, group, cfg, token_rewards=None, values=None):
    t = max(lengths)
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()
    inputs = AdvantageInputs(torch.tensor(scores, dtype=torch.float32), mask, group,
                             token_rewards, values)
    return compute_advantages(inputs, cfg)


def test_grpo_hand_worked():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # -> +-0.5 / 0.57735 = +-0.866025 on every token; a group of equal rewards gets 0
    a, _ = adv([1, 0, 0, 1, 1, 1, 1, 1], [2] * 8, 4, AlgorithmConfig(advantage="grpo"))
    assert a[:4, 0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025],
                                              abs=1e-5)
    assert torch.equal(a[:, 0], a[:, 1]) and a[4:].abs().sum() == 0


def test_dr_grpo_and_grpo_without_std():
    # centring only; group [2, 0]: mean 1 -> [1, -1]
    for cfg in (AlgorithmConfig(advantage="dr_grpo"), AlgorithmConfig(norm_by_std=False)):
        a, _ = adv([2, 0], [1, 1], 2, cfg)
        assert a[:, 0].tolist() == [1.0, -1.0]


def test_rloo_hand_worked():
    # group [1, 0, 0, 1]: r_1 - mean(0, 0, 1) = 1 - 1/3 = 0.6667; r_2 - mean(1, 0, 1) = -0.6667
    a, _ = adv([1, 0, 0, 1], [1] * 4, 4, AlgorithmConfig(advantage="rloo"))
    assert a[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_padding_gets_no_advantage():
    a, _ = adv([1, 0], [3, 1], 2, AlgorithmConfig(advantage="grpo"))
    assert a[1, 1:].tolist() == [0.0, 0.0]


def test_reinforce_pp_hand_worked():
    # scores [1, 0], lengths [2, 1]: returns [[1, 1], [0, -]]; whitened over the 3 tokens
    # (mean 2/3, std sqrt(2/9) = 0.4714): [0.7071, 0.7071], [-1.4142]
    a, ret = adv([1, 0], [2, 1], 2, AlgorithmConfig(advantage="reinforce_pp"))
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert a[0].tolist() == pytest.approx([0.70711, 0.70711], abs=1e-4)
    assert a[1, 0].item() == pytest.approx(-1.41421, abs=1e-4) and a[1, 1] == 0
    # a per-token KL penalty of -0.1 on sample 1: rewards [-0.1, 0.9] -> returns [0.8, 0.9]
    _, ret = adv([1, 0], [2, 1], 2, AlgorithmConfig(advantage="reinforce_pp"),
                 token_rewards=torch.tensor([[-0.1, -0.1], [0.0, 0.0]]))
    assert ret[0].tolist() == pytest.approx([0.8, 0.9])


def test_reinforce_pp_group_baseline():
    # group [1, 0] -> baseline-subtracted scores [0.5, -0.5] become the returns
    _, ret = adv([1, 0], [1, 1], 2, AlgorithmConfig(advantage="reinforce_pp",
                                                    reinforce_pp_group_baseline=True))
    assert ret[:, 0].tolist() == [0.5, -0.5]


def test_gae_hand_worked():
    # values [0.5, 0.2], score 1 on the last token, gamma 1, lambda 0.5:
    # delta_1 = 1 - 0.2 = 0.8 -> A_1 = 0.8; delta_0 = 0.2 - 0.5 = -0.3 -> A_0 = -0.3 + 0.5*0.8 = 0.1
    # returns = A + V = [0.6, 1.0]; whitened A (mean 0.45, std 0.35) = [-1, 1]
    cfg = AlgorithmConfig(advantage="gae", critic=True, gamma=1.0, lam=0.5)
    a, ret = adv([1.0], [2], 1, cfg, values=torch.tensor([[0.5, 0.2]]))
    assert ret[0].tolist() == pytest.approx([0.6, 1.0])
    assert a[0].tolist() == pytest.approx([-1.0, 1.0], abs=1e-4)


def gae_loop(rewards, values, gamma, lam):
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        nxt = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * nxt - values[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_and_returns_match_plain_loops():
    g = torch.Generator().manual_seed(2)
    lengths = [5, 3, 1, 4]
    scores = torch.randn(4, generator=g)
    values = torch.randn(4, 5, generator=g)
    token_rewards = 0.1 * torch.randn(4, 5, generator=g)
    cfg = AlgorithmConfig(advantage="gae", critic=True, gamma=0.9, lam=0.8)
    _, ret = adv(scores.tolist(), lengths, 1, cfg, token_rewards=token_rewards, values=values)
    for i, n in enumerate(lengths):
        rewards = token_rewards[i, :n].tolist()
        rewards[-1] += scores[i].item()
        a = gae_loop(rewards, values[i, :n].tolist(), 0.9, 0.8)
        assert ret[i, :n].tolist() == pytest.approx([x + v for x, v in zip(a, values[i, :n].tolist())],
                                                    abs=1e-5)
        assert ret[i, n:].abs().sum() == 0
        disc = discounted_returns(torch.tensor([rewards]), torch.ones(1, n), 0.9)[0].tolist()
        expect = [sum(rewards[s] * 0.9 ** (s - t) for s in range(t, n)) for t in range(n)]
        assert disc == pytest.approx(expect, abs=1e-5)


def test_grpo_matches_a_plain_loop():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(7 * 5, generator=g)
    a, _ = adv(r.tolist(), [1] * 35, 5, AlgorithmConfig())
    for p in range(7):
        group = r[p * 5:(p + 1) * 5].tolist()
        mean = sum(group) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / 4)
        for i, x in enumerate(group):
            assert a[p * 5 + i, 0].item() == pytest.approx((x - mean) / (std + 1e-6), abs=1e-5)


def test_errors():
    with pytest.raises(ValueError, match="advantage estimator 'x' is not registered; known: "
                                         "dr_grpo, gae, grpo, reinforce_pp, rloo"):
        adv([0, 1], [1, 1], 2, AlgorithmConfig(advantage="x"))
    with pytest.raises(ValueError, match="needs critic values"):
        adv([0, 1], [1, 1], 2, AlgorithmConfig(advantage="gae", critic=True))


@pytest.mark.parametrize("advantage", ["gae", "reinforce_pp", "grpo"])
def test_multi_turn_environment_tokens_are_stepped_over(advantage):
    """A multi-turn response with environment tokens (mask 0) between the model's turns gets,
    on its model tokens, exactly what the model tokens alone would get (GAE's t+1 is the next
    model token), and nothing on the environment's; the score lands on the last model token."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0],    # two observations, padded end
                         [1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]).float()
    scores, values = torch.tensor([1.0, -0.5]), torch.randn(2, 11, generator=g)
    token_rewards = 0.1 * torch.randn(2, 11, generator=g)
    cfg = AlgorithmConfig(advantage=advantage, critic=advantage == "gae", gamma=0.9, lam=0.8)
    a, ret = compute_advantages(AdvantageInputs(scores, mask, 2, token_rewards, values), cfg)
    keep = [mask[i].bool() for i in range(2)]
    n = max(int(k.sum()) for k in keep)
    packed = torch.zeros(2, n)  # the model's tokens alone, left-aligned
    pv, pr = torch.zeros(2, n), torch.zeros(2, n)
    for i, k in enumerate(keep):
        m = int(k.sum())
        packed[i, :m], pv[i, :m], pr[i, :m] = 1, values[i][k], token_rewards[i][k]
    b, ret_b = compute_advantages(AdvantageInputs(scores, packed, 2, pr, pv), cfg)
    for i, k in enumerate(keep):
        m = int(k.sum())
        assert a[i][k].tolist() == pytest.approx(b[i, :m].tolist(), abs=1e-5), advantage
        assert ret[i][k].tolist() == pytest.approx(ret_b[i, :m].tolist(), abs=1e-5), advantage
        assert a[i][~k].abs().sum() == 0 and ret[i][~k].abs().sum() == 0
