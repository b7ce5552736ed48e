"""Policy losses, value loss, KL estimators and aggregation, with hand-worked values."""
import math

import pytest
import torch

from update.config import LossConfig
from update.losses import (KL_ESTIMATORS, LOSS_AGGREGATIONS, BatchCounts, LossInputs,
                           entropy_from_logits, nll_loss, policy_loss, register, tis_weights,
                           value_loss)


def inputs(logprobs, old, adv, mask, ref=None, rollout=None, entropy=None, norm_length=1.0):
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float64)  # noqa: E731
    mask_t = t(mask)
    counts = BatchCounts(float(mask_t.sum()), float(mask_t.shape[0]), norm_length)
    return LossInputs(logprobs=t(logprobs).requires_grad_(), old_logprobs=t(old),
                      advantages=t(adv), response_mask=mask_t, counts=counts,
                      ref_logprobs=t(ref), rollout_logprobs=t(rollout), entropy=t(entropy))


def test_ppo_clip_hand_worked():
    # token 1: A=+1, ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped at 1 + 0.2)
    # token 2: A=-1, ratio 0.5 -> max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2)
    # token_mean over 2 tokens: (-1.2 + 0.8) / 2 = -0.2; both tokens clipped -> clip_frac 1
    x = inputs([[math.log(1.5), math.log(0.5)]], [[0.0, 0.0]], [[1.0, -1.0]], [[1.0, 1.0]])
    loss, m = policy_loss(x, LossConfig(clip_low=0.2, clip_high=0.2))
    assert loss.item() == pytest.approx(-0.2)
    assert m["loss/clip_frac"].item() == pytest.approx(1.0)
    loss.backward()
    assert torch.all(x.logprobs.grad == 0)  # clipped tokens carry no gradient


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


def test_dual_clip_caps_negative_advantages():
    # A=-1, ratio 5: PPO gives max(5, 1.2) = 5; dual-clip with c=3 caps it at -A*c = 3
    x = inputs([[math.log(5.0)]], [[0.0]], [[-1.0]], [[1.0]])
    assert policy_loss(x, LossConfig())[0].item() == pytest.approx(5.0)
    assert policy_loss(x, LossConfig(clip_ratio_c=3.0))[0].item() == pytest.approx(3.0)
    # positive advantages are untouched by dual-clip: A=+1, ratio 5 -> -1.2
    y = inputs([[math.log(5.0)]], [[0.0]], [[1.0]], [[1.0]])
    assert policy_loss(y, LossConfig(clip_ratio_c=3.0))[0].item() == pytest.approx(-1.2)


def test_gspo_sequence_ratio():
    # log-ratios [ln 2, 0] -> sequence ratio exp(ln2 / 2) = sqrt(2) = 1.4142 for both tokens.
    # A=+1, clip_high 0.2: each token max(-1.4142, -1.2) = -1.2, no gradient.
    x = inputs([[math.log(2.0), 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], [[1.0, 1.0]])
    loss, m = policy_loss(x, LossConfig(policy_loss="gspo"))
    assert loss.item() == pytest.approx(-1.2)
    assert m["loss/ratio_mean"].item() == pytest.approx(math.sqrt(2))
    # unclipped (clip_high 1.0): loss -sqrt(2); d/dlogp_t = -s * 1 / 2 tokens each
    y = inputs([[math.log(2.0), 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], [[1.0, 1.0]])
    loss, _ = policy_loss(y, LossConfig(policy_loss="gspo", clip_high=1.0))
    loss.backward()
    assert loss.item() == pytest.approx(-math.sqrt(2))
    assert y.logprobs.grad[0].tolist() == pytest.approx([-math.sqrt(2) / 2] * 2)


def test_plain_policy_gradient():
    # loss = -A * logp, token mean: -(2 * -0.5 + -1 * -1.0) / 2 = 0.0; grad = -A / 2
    x = inputs([[-0.5, -1.0]], [[-0.9, -0.2]], [[2.0, -1.0]], [[1.0, 1.0]])
    loss, _ = policy_loss(x, LossConfig(policy_loss="pg"))
    loss.backward()
    assert loss.item() == pytest.approx(0.0)
    assert x.logprobs.grad[0].tolist() == pytest.approx([-1.0, 0.5])


def test_truncated_importance_sampling():
    # pi_trainer / pi_rollout = 3, capped at 2: the on-policy loss -A * 1 becomes -2
    x = inputs([[0.0]], [[0.0]], [[1.0]], [[1.0]], rollout=[[-math.log(3.0)]])
    loss, m = policy_loss(x, LossConfig(tis_cap=2.0))
    assert loss.item() == pytest.approx(-2.0)
    assert m["mismatch/tis_weight_mean"].item() == pytest.approx(2.0)
    assert policy_loss(x, LossConfig(tis_cap=0.0))[0].item() == pytest.approx(-1.0)  # off
    assert tis_weights(torch.tensor([0.0]), torch.tensor([0.5]), 2.0).item() == \
        pytest.approx(math.exp(-0.5))


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo", "pg"])
def test_decoupled_equals_tis_when_behavior_is_proximal(policy):
    """Every token's behavior logprob equal to the proximal one: weight 1 under both, so the
    losses and gradients agree (off-policy tokens are where they part)."""
    torch.manual_seed(0)
    old = torch.randn(3, 5).double().tolist()
    lp = (torch.tensor(old) + 0.1 * torch.randn(3, 5).double()).tolist()
    adv = torch.randn(3, 5).double().tolist()
    mask = [[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]]
    grads = {}
    for correction in ("tis", "decoupled"):
        x = inputs(lp, old, adv, mask, rollout=old)
        loss, m = policy_loss(x, LossConfig(policy_loss=policy, correction=correction))
        loss.backward()
        grads[correction] = (loss.item(), x.logprobs.grad.clone())
        assert m["mismatch/tis_weight_mean"].item() == pytest.approx(1.0)
    assert grads["tis"][0] == pytest.approx(grads["decoupled"][0], abs=1e-12)
    assert torch.allclose(grads["tis"][1], grads["decoupled"][1], atol=1e-12)


def test_decoupled_drops_tokens_over_the_cap_where_tis_cuts_them():
    # token 1: pi_prox / pi_behavior = 3 > cap 2: tis weights it 2, decoupled drops it
    # token 2: ratio 1.5 <= cap: both weight it 1.5
    # on-policy to the proximal policy (ratio to it 1, no clip), A = 1: token loss -1 x weight
    behavior = [[-math.log(3.0), -math.log(1.5)]]
    x = lambda: inputs([[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], [[1.0, 1.0]],  # noqa: E731
                       rollout=behavior)
    tis, _ = policy_loss(x(), LossConfig(tis_cap=2.0, correction="tis"))
    dec, m = policy_loss(x(), LossConfig(tis_cap=2.0, correction="decoupled"))
    none, _ = policy_loss(x(), LossConfig(tis_cap=2.0, correction="none"))
    assert tis.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert dec.item() == pytest.approx(-(0.0 + 1.5) / 2)
    assert m["mismatch/dropped_tokens"].item() == pytest.approx(0.5)
    # none: the ratio is to the behavior policy (3 and 1.5), clipped at 1 + 0.2, no weight
    assert none.item() == pytest.approx(-1.2)


def test_decoupled_weights_the_kl_term_of_off_policy_tokens():
    # a stale token the policy has since made unlikely (logp -8, ref -1, behavior -1): its k3
    # is exp(7) - 8 ~ 1089; decoupled weights it by pi_prox / pi_behavior = exp(-7)
    lp, ref, behavior = [[-8.0]], [[-1.0]], [[-1.0]]
    k3 = math.exp(7.0) - 7.0 - 1.0
    x = lambda: inputs(lp, lp, [[0.0]], [[1.0]], ref=ref, rollout=behavior)  # noqa: E731
    _, tis = policy_loss(x(), LossConfig(kl_coef=0.1, correction="tis"))
    _, dec = policy_loss(x(), LossConfig(kl_coef=0.1, correction="decoupled"))
    assert tis["loss/kl"].item() == pytest.approx(k3)
    assert dec["loss/kl"].item() == pytest.approx(k3 * math.exp(-7.0))


def test_none_takes_its_ratio_to_the_behavior_policy():
    # the policy moved a token from behavior logprob -1 to -0.5 since it was generated: its
    # ratio is exp(0.5) ~ 1.65 > 1.2, so with A > 0 it is clipped (no gradient); with A < 0 the
    # unclipped term binds and the gradient is -A * ratio
    lp, behavior = [[-0.5, -0.5]], [[-1.0, -1.0]]
    x = inputs(lp, lp, [[1.0, -1.0]], [[1.0, 1.0]], rollout=behavior)
    loss, m = policy_loss(x, LossConfig(correction="none"))
    loss.backward()
    r = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.2 + r) / 2)
    assert x.logprobs.grad[0].tolist() == pytest.approx([0.0, r / 2])
    assert m["loss/clip_frac"].item() == pytest.approx(0.5)
    assert "mismatch/tis_weight_mean" not in m


def test_an_unknown_correction_lists_the_known_ones():
    x = inputs([[0.0]], [[0.0]], [[1.0]], [[1.0]], rollout=[[0.0]])
    with pytest.raises(ValueError, match="decoupled, none, tis"):
        policy_loss(x, LossConfig(correction="bogus"))


def test_entropy_bonus_and_metric():
    # on-policy A=0: loss = -entropy_coef * entropy = -0.1 * 1.5
    x = inputs([[0.0]], [[0.0]], [[0.0]], [[1.0]], entropy=[[1.5]])
    loss, m = policy_loss(x, LossConfig(entropy_coef=0.1))
    assert loss.item() == pytest.approx(-0.15) and m["entropy/mean"].item() == pytest.approx(1.5)
    # uniform over 4 tokens: entropy log 4
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))


def test_kl_estimators_hand_worked():
    # pi = 0.5, pi_ref = 0.25: k1 = log 2; k2 = (log 2)^2 / 2; k3 = r - log r - 1, r = 0.5
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert KL_ESTIMATORS["k1"](lp, ref).item() == pytest.approx(math.log(2))
    assert KL_ESTIMATORS["k2"](lp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert KL_ESTIMATORS["k3"](lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    for fn in KL_ESTIMATORS.values():  # identical policies: every estimator is 0
        assert fn(lp, lp).item() == pytest.approx(0.0)


def test_kl_loss_term_and_reward_mode():
    # on-policy, A = 0: the loss is kl_coef * k3 = 0.1 * (0.5 - log 0.5 - 1)
    x = inputs([[math.log(0.5)]], [[math.log(0.5)]], [[0.0]], [[1.0]], ref=[[math.log(0.25)]])
    loss, m = policy_loss(x, LossConfig(kl_coef=0.1, kl_estimator="k3"))
    assert loss.item() == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1))
    assert m["loss/kl"].item() == pytest.approx(0.5 - math.log(0.5) - 1)
    # KL as a reward penalty instead: no KL term in the loss
    loss, m = policy_loss(x, LossConfig(kl_coef=0.1, use_kl_loss=False))
    assert loss.item() == pytest.approx(0.0) and "loss/kl" not in m


def test_aggregations_hand_worked():
    loss_tok = torch.tensor([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    counts = BatchCounts(num_tokens=3.0, num_seqs=2.0, norm_length=4.0)
    # token_mean: (1 + 3 + 5) / 3 tokens = 3
    assert LOSS_AGGREGATIONS["token_mean"](loss_tok, mask, counts).item() == pytest.approx(3.0)
    # seq_mean_token_mean: seq means 2 and 5 -> 3.5
    assert LOSS_AGGREGATIONS["seq_mean_token_mean"](loss_tok, mask, counts).item() == \
        pytest.approx(3.5)
    # seq_mean_token_sum_norm (Dr.GRPO): (4 / 4 + 5 / 4) / 2 seqs = 1.125
    assert LOSS_AGGREGATIONS["seq_mean_token_sum_norm"](loss_tok, mask, counts).item() == \
        pytest.approx(1.125)


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo", "pg"])
def test_loss_and_grad_invariant_to_micro_batch_split(agg, loss_name):
    # The same batch as one piece or split in micro-batches (or ranks) gives the same loss and
    # the same gradient, because every piece is normalized by the global counts.
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    logp = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    cfg = LossConfig(loss_agg=agg, policy_loss=loss_name)
    counts = BatchCounts(float(mask.sum()), float(b), float(t))

    def run(splits):
        leaf = logp.clone().requires_grad_()
        total = 0.0
        for idx in splits:
            loss, _ = policy_loss(LossInputs(leaf[idx], old[idx], adv[idx], mask[idx], counts), cfg)
            loss.backward()
            total += loss.item()
        return total, leaf.grad

    whole, grad_whole = run([list(range(b))])
    parts, grad_parts = run([[0, 1], [2, 3, 4], [5]])
    assert parts == pytest.approx(whole)
    assert torch.allclose(grad_parts, grad_whole)


def test_value_loss_hand_worked():
    # V=1.0, V_old=0.5, R=2.0, clip 0.2: (1-2)^2 = 1; clipped V = 0.7 -> (0.7-2)^2 = 1.69
    # 0.5 * max(1, 1.69) = 0.845
    loss, m = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]),
                         torch.tensor([[1.0]]), 0.2, BatchCounts(1.0, 1.0))
    assert loss.item() == pytest.approx(0.845) and m["values/mean"].item() == pytest.approx(1.0)


def test_nll_loss():
    # -(log 0.5 + log 0.25) / 2 tokens
    lp = torch.tensor([[math.log(0.5), math.log(0.25), 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert nll_loss(lp, mask, 2.0).item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)


def test_unknown_names_list_the_known_ones():
    x = inputs([[0.0]], [[0.0]], [[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="policy loss 'nope' is not registered; known: gspo, pg"):
        policy_loss(x, LossConfig(policy_loss="nope"))
    with pytest.raises(ValueError, match="known: seq_mean_token_mean, seq_mean_token_sum_norm"):
        policy_loss(x, LossConfig(loss_agg="nope"))


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        register(KL_ESTIMATORS, "k1")(lambda a, b: a)
