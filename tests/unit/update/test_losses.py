"""Policy loss, KL estimators and aggregation, with hand-worked values."""
import math

import pytest
import torch

from update.config import LossConfig
from update.losses import (KL_ESTIMATORS, LOSS_AGGREGATIONS, LossInputs, nll_loss, policy_loss,
                           register)


def inputs(logprobs, old, adv, mask, ref=None):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    mask_t = t(mask)
    return LossInputs(logprobs=t(logprobs).requires_grad_(), old_logprobs=t(old),
                      advantages=t(adv), response_mask=mask_t,
                      num_tokens=float(mask_t.sum()), num_seqs=float(mask_t.shape[0]),
                      ref_logprobs=None if ref is None else t(ref))


def test_ppo_clip_hand_worked():
    # token 1: A=+1, ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped at 1 + 0.2)
    # token 2: A=-1, ratio 0.5 -> max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2)
    # token_mean over 2 tokens: (-1.2 + 0.8) / 2 = -0.2; both tokens clipped -> clip_frac 1
    x = inputs([[math.log(1.5), math.log(0.5)]], [[0.0, 0.0]], [[1.0, -1.0]], [[1.0, 1.0]])
    loss, m = policy_loss(x, LossConfig(clip_low=0.2, clip_high=0.2))
    assert loss.item() == pytest.approx(-0.2)
    assert m["loss/clip_frac"].item() == pytest.approx(1.0)
    # clipped tokens carry no gradient
    loss.backward()
    assert torch.all(x.logprobs.grad == 0)


def test_ppo_unclipped_gradient_is_policy_gradient():
    # ratio 1 (on-policy): d/dlogp of -A * exp(logp - old) = -A; token_mean divides by 2 tokens
    x = inputs([[0.3, -0.7]], [[0.3, -0.7]], [[2.0, -1.0]], [[1.0, 1.0]])
    loss, _ = policy_loss(x, LossConfig())
    loss.backward()
    assert x.logprobs.grad[0].tolist() == pytest.approx([-1.0, 0.5])
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)


def test_clip_higher_asymmetric():
    # A=+1, ratio 1.25: clip_high 0.28 (DAPO) leaves it unclipped -> -1.25; clip_high 0.2 -> -1.2
    x = inputs([[math.log(1.25)]], [[0.0]], [[1.0]], [[1.0]])
    assert policy_loss(x, LossConfig(clip_high=0.28))[0].item() == pytest.approx(-1.25)
    assert policy_loss(x, LossConfig(clip_high=0.2))[0].item() == pytest.approx(-1.2)


def test_kl_estimators_hand_worked():
    # pi = 0.5, pi_ref = 0.25: k1 = log 2; k2 = (log 2)^2 / 2; k3 = r - log r - 1, r = 0.5
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert KL_ESTIMATORS["k1"](lp, ref).item() == pytest.approx(math.log(2))
    assert KL_ESTIMATORS["k2"](lp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert KL_ESTIMATORS["k3"](lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    # identical policies: every estimator is 0
    for fn in KL_ESTIMATORS.values():
        assert fn(lp, lp).item() == pytest.approx(0.0)


def test_kl_term_added_to_loss():
    # on-policy, A = 0: the loss is just kl_coef * k3 = 0.1 * (0.5 - log 0.5 - 1)
    x = inputs([[math.log(0.5)]], [[math.log(0.5)]], [[0.0]], [[1.0]], ref=[[math.log(0.25)]])
    loss, m = policy_loss(x, LossConfig(kl_coef=0.1, kl_estimator="k3"))
    assert loss.item() == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1))
    assert m["kl/mean"].item() == pytest.approx(0.5 - math.log(0.5) - 1)


def test_seq_mean_token_mean_hand_worked():
    # seq 1 tokens [1, 3] -> mean 2; seq 2 tokens [5] -> mean 5; mean over seqs = 3.5
    loss_tok = torch.tensor([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    agg = LOSS_AGGREGATIONS["seq_mean_token_mean"]
    assert agg(loss_tok, mask, 3.0, 2.0).item() == pytest.approx(3.5)
    # token_mean: (1 + 3 + 5) / 3 tokens = 3
    assert LOSS_AGGREGATIONS["token_mean"](loss_tok, mask, 3.0, 2.0).item() == pytest.approx(3.0)


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS))
def test_loss_and_grad_invariant_to_micro_batch_split(agg):
    # The same batch as one piece or split in micro-batches (or ranks) gives the same loss and
    # the same gradient, because every piece is normalized by the global counts.
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    logp = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    cfg = LossConfig(loss_agg=agg)
    n_tok, n_seq = float(mask.sum()), float(b)

    def run(splits):
        leaf = logp.clone().requires_grad_()
        total = 0.0
        for idx in splits:
            x = LossInputs(leaf[idx], old[idx], adv[idx], mask[idx], n_tok, n_seq)
            loss, _ = policy_loss(x, cfg)
            loss.backward()
            total += loss.item()
        return total, leaf.grad

    whole, grad_whole = run([list(range(b))])
    parts, grad_parts = run([[0, 1], [2, 3, 4], [5]])
    assert parts == pytest.approx(whole)
    assert torch.allclose(grad_parts, grad_whole)


def test_nll_loss():
    # -(log 0.5 + log 0.25) / 2 tokens
    lp = torch.tensor([[math.log(0.5), math.log(0.25), 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert nll_loss(lp, mask, 2.0).item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)


def test_unknown_names_list_the_known_ones():
    x = inputs([[0.0]], [[0.0]], [[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="known: ppo_clip"):
        policy_loss(x, LossConfig(policy_loss="nope"))
    with pytest.raises(ValueError, match="known: seq_mean_token_mean, token_mean"):
        policy_loss(x, LossConfig(loss_agg="nope"))


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        register(KL_ESTIMATORS, "k1")(lambda a, b: a)
