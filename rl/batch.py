"""Samples and the padded tensors the trainer consumes.

Glossary: B samples, L = longest prompt + response in the micro-batch; token-level tensors are
[B, L-1], aligned with the logprob of token t+1 given tokens <= t.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    row: int  # index of the dataset row the prompt came from
    group: int  # index of the prompt within the step (samples of one prompt share it)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    text: str
    reward: float = 0.0
    advantage: float = 0.0


def collate(samples: list[Sample], pad_id: int) -> dict:
    """Right-padded tensors for one micro-batch."""
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    response_mask = torch.zeros((b, length - 1))
    advantages = torch.zeros((b, length - 1))
    rollout_logprobs = torch.zeros((b, length - 1))
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, :p + r] = 1
        # logprob index t scores token t+1: response tokens sit at p .. p+r-1
        response_mask[i, p - 1:p + r - 1] = 1.0
        advantages[i, p - 1:p + r - 1] = s.advantage
        if s.rollout_logprobs:
            rollout_logprobs[i, p - 1:p + r - 1] = torch.tensor(s.rollout_logprobs)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "response_mask": response_mask, "advantages": advantages,
            "rollout_logprobs": rollout_logprobs}


def chunk(items: list, parts: int) -> list[list]:
    """Split into `parts` contiguous chunks whose sizes differ by at most one."""
    k, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@dataclass
class UpdatePlan:
    """mini_batches[m][rank] is that rank's list of micro-batches for optimizer step m."""
    mini_batches: list[list[list[dict]]]
    num_tokens: list[float]  # response tokens per mini-batch, all ranks together
    num_seqs: list[float]


def plan_update(samples: list[Sample], world_size: int, num_mini_batches: int,
                grad_accum: int, pad_id: int, seed: int) -> UpdatePlan:
    """Shuffle, split into mini-batches, then ranks, then exactly `grad_accum` micro-batches."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    plan = UpdatePlan([], [], [])
    for mini in chunk(order, num_mini_batches):
        plan.num_tokens.append(float(sum(len(s.response_ids) for s in mini)))
        plan.num_seqs.append(float(len(mini)))
        ranks = []
        for rank_samples in chunk(mini, world_size):
            micros = [m for m in chunk(rank_samples, grad_accum) if m]
            if len(micros) != grad_accum:
                raise ValueError(f"{len(rank_samples)} samples on a rank cannot fill "
                                 f"{grad_accum} micro-batches; check trainer.micro_batch_size")
            ranks.append([collate(m, pad_id) for m in micros])
        plan.mini_batches.append(ranks)
    return plan
