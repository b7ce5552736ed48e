"""Padded micro-batches and the split of a rollout batch over mini-batches, ranks, micro-batches."""
import pytest

from rl.batch import Sample, chunk, collate, plan_update, response_slice


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

    from rl.models import build_tiny_model

    path = build_tiny_model("tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_padded_micro_batch_scores_each_response_like_the_sample_alone(tiny_lm):
    import torch

    from update.trainer import response_forward, token_logprobs

    samples = [sample([5, 6, 7, 8, 9], [10, 11]), sample([5], [12, 13, 14, 15]),
               sample([7, 8], [9])]
    b = collate(samples, pad_id=0)
    with torch.no_grad():
        got = token_logprobs(response_forward(tiny_lm, b).logits, b["input_ids"])
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            alone = token_logprobs(tiny_lm(input_ids=ids).logits, ids)[0, -len(s.response_ids):]
            assert torch.allclose(got[i, :len(s.response_ids)], alone, atol=1e-5), i
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
