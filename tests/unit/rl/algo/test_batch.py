"""Padded micro-batches and the split of a rollout batch over mini-batches, ranks, micro-batches."""
import pytest
import torch

from rl.algo.batch import Sample, chunk, collate, plan_update, response_slice
from tests.numerics import depth, rounding, width


def sample(prompt, response, adv=0.0, lps=None):
    return Sample(0, 0, prompt, response, lps or [0.0] * len(response), "stop", "",
                  advantages=[adv] * len(response))


def test_collate_left_pads_prompts_and_keeps_token_fields_response_only():
    # every response starts at column P (= 3, the longest prompt); token fields are [B, R]
    b = collate([sample([5, 6, 7], [8, 9], adv=0.5, lps=[-1.0, -2.0]), sample([5], [4])], pad_id=0)
    assert "old_logprobs" not in b  # token fields appear only when every sample has them
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [0, 0, 5, 4, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1]]
    assert b["response_mask"].tolist() == [[1, 1], [1, 0]]
    assert b["advantages"].tolist() == [[0.5, 0.5], [0, 0]]
    assert b["rollout_logprobs"].tolist() == [[-1.0, -2.0], [0, 0]]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from rl.data.models import build_tiny_model

    path = build_tiny_model("tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_padded_micro_batch_scores_each_response_like_the_sample_alone(tiny_lm):
    import torch

    from update.forward import response_logits, response_targets, token_logprobs

    samples = [sample([5, 6, 7, 8, 9], [10, 11]), sample([5], [12, 13, 14, 15]),
               sample([7, 8], [9]), sample([5], [16, 17])]
    for share in (False, True):  # the shared layout runs prompt [5] once for two samples
        b = collate(samples, pad_id=0, share_prompts=share)
        with torch.no_grad():
            got = token_logprobs(response_logits(tiny_lm, b), response_targets(b))
            for i, s in enumerate(samples):
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                alone = token_logprobs(tiny_lm(input_ids=ids).logits[:, :-1], ids[:, 1:])
                alone = alone[0, -len(s.response_ids):]
                tol = rounding(float(alone.abs().max()), depth(tiny_lm.config),
                               width(tiny_lm.config))  # another batch shape and padding
                assert float((got[i, :len(s.response_ids)] - alone).abs().max()) <= tol, (share, i)
        assert got.shape == b["response_mask"].shape


def test_chunk_sizes_differ_by_at_most_one():
    assert [len(c) for c in chunk(list(range(7)), 3)] == [3, 2, 2]
    assert sum(chunk(list(range(7)), 3), []) == list(range(7))


def test_plan_update_counts_global_tokens_and_fills_every_micro_batch():
    samples = [sample([1, 2], [3] * (i % 3 + 1)) for i in range(16)]
    plan = plan_update(samples, world_size=2, num_mini_batches=2, grad_accum=2, pad_id=0, seed=0)
    assert len(plan.mini_batches) == 2
    assert all(len(ranks) == 2 and all(len(m) == 2 for m in ranks) for ranks in plan.mini_batches)
    assert [c.num_seqs for c in plan.counts] == [8.0, 8.0]
    # the planned token counts equal the response tokens that land in the micro-batches
    for ranks, counts in zip(plan.mini_batches, plan.counts):
        assert sum(float(mb["response_mask"].sum()) for r in ranks for mb in r) == counts.num_tokens
    assert sum(c.num_tokens for c in plan.counts) == sum(len(s.response_ids) for s in samples)


def test_plan_update_refuses_a_split_that_leaves_a_micro_batch_empty():
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        plan_update([sample([1], [2])] * 4, world_size=2, num_mini_batches=1, grad_accum=4,
                    pad_id=0, seed=0)


def test_response_slice_inverts_collate():
    s = sample([5, 6, 7], [8, 9], adv=0.25)
    b = collate([s, sample([1], [2, 3, 4])], pad_id=0)
    assert response_slice(s, b["advantages"][0]) == [0.25, 0.25]


def grouped_samples(seed: int = 0):
    """3 prompts x 3 samples of different lengths, each with advantages and rollout logprobs."""
    import random

    rng = random.Random(seed)
    samples = []
    for g in range(3):
        prompt = [rng.randrange(3, 300) for _ in range(3 + 2 * g)]
        for _ in range(3):
            response = [rng.randrange(3, 300) for _ in range(rng.randint(1, 5))]
            s = sample(prompt, response, adv=rng.uniform(-1, 1),
                       lps=[-rng.uniform(1, 3) for _ in response])
            s.group = g
            samples.append(s)
    return samples


def test_shared_prompt_layout_holds_each_prompt_once_and_expands_to_the_full_layout():
    from update.forward import full_layout

    samples = grouped_samples()
    shared = collate(samples, pad_id=0, share_prompts=True)
    assert shared["prompt_ids"].shape[0] == 3 and "input_ids" not in shared
    assert shared["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    full = collate(samples, pad_id=0)
    expanded = full_layout(shared)
    assert sorted(expanded) == sorted(full)
    for key in full:  # the same tensors, exactly: the trainer may take either layout
        assert expanded[key].tolist() == full[key].tolist(), key


def test_shared_prompt_forward_gives_the_full_layouts_loss_and_gradients(tiny_lm):
    """Gradients flow back into each prompt's pass through its cached keys and values."""
    import torch

    from update.forward import response_logits, response_targets, token_logprobs

    samples = grouped_samples(1)
    grads, values = [], []
    for share in (False, True):
        b = collate(samples, pad_id=0, share_prompts=share)
        tiny_lm.zero_grad()
        logprobs = token_logprobs(response_logits(tiny_lm, b), response_targets(b))
        loss = (logprobs * b["advantages"] * b["response_mask"]).sum() / b["response_mask"].sum()
        loss.backward()
        values.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in tiny_lm.parameters()]))
    tiny_lm.zero_grad()
    layers, terms = depth(tiny_lm.config), width(tiny_lm.config)
    assert abs(values[1] - values[0]) <= rounding(abs(values[0]), layers, terms)
    assert float(grads[0].abs().max()) > 1e-3  # the comparison means something
    # the backward: the forward's depth again
    assert float((grads[1] - grads[0]).abs().max()) <= rounding(float(grads[0].abs().max()),
                                                                 2 * layers, terms)


def random_model_rounding(config) -> float:
    """tests/numerics.rounding of a little-trained model's logprobs: near-uniform, about log V
    (twice that allowed)."""
    import math

    return rounding(2 * math.log(config.vocab_size), depth(config), width(config))


@pytest.mark.parametrize("recompute", [False, True])
def test_check_shared_prompts_passes_on_a_real_model_and_fails_on_a_forward_that_drops_the_cache(
        tiny_lm, recompute):
    """Under recompute (gradient checkpointing, train mode) the check compares gradients too."""
    import copy

    import torch

    from update.forward import check_shared_prompts

    model = copy.deepcopy(tiny_lm)  # the check turns checkpointing on
    diff, error = check_shared_prompts(model, model.config.vocab_size, recompute)
    assert diff <= random_model_rounding(model.config) and error == ""

    class NoCache(torch.nn.Module):  # a model whose forward ignores past keys and values
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, past_key_values=None, **kw):
            return self.inner(**kw)

        def gradient_checkpointing_enable(self):
            self.inner.gradient_checkpointing_enable()

    diff, _ = check_shared_prompts(NoCache(model), model.config.vocab_size, recompute)
    assert diff > 0.1


def test_the_start_up_check_runs_on_a_small_float32_copy_of_the_architecture(tiny_lm):
    import torch

    from update.forward import check_model_class

    state = torch.random.get_rng_state()
    diff, error = check_model_class(tiny_lm.config)
    assert diff <= random_model_rounding(tiny_lm.config) and error == ""
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's random state is its own


def test_plan_update_with_shared_prompts_keeps_each_group_in_one_micro_batch():
    samples = [sample([g, g + 1], [3] * (i % 3 + 1)) for g in range(8) for i in range(4)]
    for g in range(8):
        for s in samples[4 * g:4 * g + 4]:
            s.group = g
    plan = plan_update(samples, world_size=2, num_mini_batches=2, grad_accum=2, pad_id=0, seed=3,
                       share_prompts=True)
    micro_batches = [mb for ranks in plan.mini_batches for r in ranks for mb in r]
    assert len(micro_batches) == 8
    for mb in micro_batches:  # 4 samples of one prompt: one prompt row each
        assert mb["prompt_ids"].shape[0] == 1 and mb["prompt_index"].tolist() == [0] * 4
    assert sum(c.num_tokens for c in plan.counts) == sum(len(s.response_ids) for s in samples)


def multi_turn(prompt, turns):
    """A trajectory whose response is the model's turns with environment tokens between them:
    turns = [(tokens, is_model), ...]."""
    ids = [t for tokens, _ in turns for t in tokens]
    mask = [int(model) for tokens, model in turns for _ in tokens]
    return Sample(0, 0, prompt, ids, [0.0] * len(ids), "stop", "", loss_mask=mask)


def test_environment_tokens_are_attended_to_but_take_no_part_in_the_loss():
    s = multi_turn([5, 6], [([8, 9], True), ([20, 21, 22], False), ([10], True)])
    assert s.num_model_tokens == 3
    for shared in (False, True):
        b = collate([s, sample([5], [4, 7])], pad_id=0, share_prompts=shared)
        assert b["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]]
        assert b["response_attention_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
        if not shared:
            assert b["attention_mask"][0].tolist() == [1, 1] + [1] * 6
    plan = plan_update([s, sample([5], [4, 7])], world_size=1, num_mini_batches=1,
                       grad_accum=1, pad_id=0, seed=0)
    assert plan.counts[0].num_tokens == 3 + 2  # the model's tokens only


def test_shared_prompt_forward_attends_to_environment_tokens(tiny_lm):
    """The shared layout's logits equal the full layout's on a multi-turn batch: both attend
    to the environment's tokens (were the loss mask used for attention, a model token after an
    observation would not see it)."""
    from update.forward import full_layout, response_logits

    samples = [multi_turn([5, 6, 7], [([8, 9], True), ([20, 21, 22], False), ([10, 11], True)]),
               multi_turn([5, 6, 7], [([12], True), ([30, 31], False), ([13], True)])]
    shared = collate(samples, pad_id=0, share_prompts=True)
    full = full_layout(shared)
    with torch.no_grad():
        a, b = response_logits(tiny_lm, shared), response_logits(tiny_lm, full)
    attended = shared["response_attention_mask"].bool()
    assert float((a[attended] - b[attended]).abs().max()) <= rounding(
        float(b[attended].abs().max()), depth(tiny_lm.config), width(tiny_lm.config))
    blind = dict(full, attention_mask=torch.cat([torch.ones(2, 3, dtype=torch.long),
                                                 shared["response_mask"].long()], 1))
    with torch.no_grad():
        c = response_logits(tiny_lm, blind)
    after = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0, 0]]).bool()
    assert not torch.allclose(a[after], c[after], atol=1e-3)  # the test can tell the two apart


def test_environment_positions_add_no_term_to_the_loss_kl_or_gradient(tiny_lm):
    """Whatever advantages, behavior (old/rollout) and reference logprobs the observation
    positions hold, the policy loss, its KL term and the gradient stay the same; were the
    attention mask used as the loss mask, they would change."""
    from update.config import LossConfig
    from update.forward import response_logits, response_targets, token_logprobs
    from update.losses import BatchCounts, LossInputs, policy_loss

    samples = [multi_turn([5, 6, 7], [([8, 9], True), ([20, 21, 22], False), ([10, 11], True)]),
               multi_turn([5, 6, 7], [([12], True), ([30, 31], False), ([13], True)])]
    batch = collate(samples, pad_id=0)
    cfg = LossConfig(kl_coef=0.1, use_kl_loss=True, correction="tis", clip_low=0.1)
    env = batch["response_attention_mask"].bool() & ~batch["response_mask"].bool()
    assert env.sum() == 5
    shape = env.shape
    gen = torch.Generator().manual_seed(0)
    base = {k: -torch.rand(shape, generator=gen) for k in ("old", "rollout", "ref")}
    base["adv"] = torch.randn(shape, generator=gen)

    def run(fields, mask_key):
        tiny_lm.zero_grad()
        logprobs = token_logprobs(response_logits(tiny_lm, batch), response_targets(batch))
        mask = batch[mask_key]
        loss, metrics = policy_loss(LossInputs(
            logprobs, fields["old"], fields["adv"], mask, BatchCounts(float(mask.sum()), 2.0),
            ref_logprobs=fields["ref"], rollout_logprobs=fields["rollout"]), cfg)
        loss.backward()
        return loss.detach(), metrics["loss/kl"], [p.grad.clone() for p in tiny_lm.parameters()
                                                   if p.grad is not None]

    scrambled = {k: torch.where(env, v + 5.0 * torch.randn(shape, generator=gen), v)
                 for k, v in base.items()}
    for mask_key, same in (("response_mask", True), ("response_attention_mask", False)):
        a, b = run(base, mask_key), run(scrambled, mask_key)
        equal = [torch.equal(a[0], b[0]), torch.equal(a[1], b[1]),
                 all(torch.equal(x, y) for x, y in zip(a[2], b[2]))]
        assert equal == [same] * 3, (mask_key, equal)
