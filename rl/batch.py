"""Samples and the padded tensors the trainer consumes.

Glossary: B samples, P = longest prompt, R = longest response in the micro-batch, L = P + R.
`collate` left-pads prompts and right-pads responses, so every response starts at column P:
token-level tensors are response-only, [B, R], entry j belonging to response token j, and the
trainer computes logits for the last R + 1 positions only (not the prompts', which for a real
vocabulary are most of the logits' memory and time).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from update.losses import MAX_METRICS, BatchCounts

TOKEN_FIELDS = ("advantages", "returns", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                "values")


@dataclass
class Sample:
    row: int  # index of the dataset row the prompt came from
    group: int  # index of the prompt within the step (samples of one prompt share it)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    text: str
    reward: float = 0.0  # the reward function's value
    score: float = 0.0  # reward + shaping (e.g. overlong penalty): what advantages use
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    policy_version: int = 0  # the version of the engine that generated its first token
    token_versions: list[int] = field(default_factory=list)  # per token (async modes only)


def collate(samples: list[Sample], pad_id: int) -> dict:
    """Padded tensors for one micro-batch (token fields only where every sample has them):
    input_ids/attention_mask/position_ids [B, L] with prompts left-padded and responses
    right-padded; response_mask and token fields [B, R]."""
    p_max = max(len(s.prompt_ids) for s in samples)
    r_max = max(len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, p_max + r_max), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p_max + r_max), dtype=torch.long)
    response_mask = torch.zeros((b, r_max))
    present = [f for f in TOKEN_FIELDS if all(getattr(s, f) for s in samples)]
    tokens = {f: torch.zeros((b, r_max)) for f in present}
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, p_max - p:p_max + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, p_max - p:p_max + r] = 1
        response_mask[i, :r] = 1.0
        for f in present:
            tokens[f][i, :r] = torch.tensor(getattr(s, f), dtype=torch.float32)
    # positions count real tokens only, as in the rollout engine (left pads do not shift them)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids, "response_mask": response_mask, **tokens}


def response_slice(sample: Sample, row: torch.Tensor) -> list[float]:
    """A sample's values from a [R] token-level row, as a list."""
    return row[:len(sample.response_ids)].tolist()


def chunk(items: list, parts: int) -> list[list]:
    """Split into `parts` contiguous chunks whose sizes differ by at most one."""
    k, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def split_ranks(samples: list[Sample], world_size: int, grad_accum: int) -> list[list[list[Sample]]]:
    """[rank][micro] lists of samples: every rank gets exactly `grad_accum` micro-batches, so
    ZeRO-3's collective forwards stay in step."""
    out = []
    for rank_samples in chunk(samples, world_size):
        micros = [m for m in chunk(rank_samples, grad_accum) if m]
        if len(micros) != grad_accum:
            raise ValueError(f"{len(rank_samples)} samples on a rank cannot fill "
                             f"{grad_accum} micro-batches; check trainer.micro_batch_size")
        out.append(micros)
    return out


@dataclass
class UpdatePlan:
    """mini_batches[m][rank] is that rank's list of micro-batches for optimizer step m."""
    mini_batches: list[list[list[dict]]]
    counts: list[BatchCounts]  # per mini-batch, all ranks together


def plan_update(samples: list[Sample], world_size: int, num_mini_batches: int,
                grad_accum: int, pad_id: int, seed: int) -> UpdatePlan:
    """Shuffle, split into mini-batches, then ranks, then exactly `grad_accum` micro-batches."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    plan = UpdatePlan([], [])
    for mini in chunk(order, num_mini_batches):
        plan.counts.append(BatchCounts(num_tokens=float(sum(len(s.response_ids) for s in mini)),
                                       num_seqs=float(len(mini))))
        plan.mini_batches.append([[collate(m, pad_id) for m in micros]
                                  for micros in split_ranks(mini, world_size, grad_accum)])
    return plan


def padded(samples: list[Sample], name: str) -> torch.Tensor:
    """[B, T] response-only token values of `name` (T = the longest response), zero-padded."""
    width = max(len(s.response_ids) for s in samples)
    out = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        values = getattr(s, name)
        out[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def response_mask(samples: list[Sample]) -> torch.Tensor:
    width = max(len(s.response_ids) for s in samples)
    return (torch.arange(width)[None, :] <
            torch.tensor([len(s.response_ids) for s in samples])[:, None]).float()


def reduce_rank_metrics(results: list[dict]) -> dict:
    """Ranks return their shares of global means: sum them (maxima: the max); grad norms are
    global already."""
    return {k: (results[0][k] if k == "grad_norm" else
                max(r[k] for r in results) if k in MAX_METRICS else sum(r[k] for r in results))
            for k in results[0]}
