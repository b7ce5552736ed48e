"""Samples and the padded tensors the trainer consumes.

Glossary: B samples, G distinct prompts, P = longest prompt, R = longest response in the
micro-batch, L = P + R. `collate` left-pads prompts and right-pads responses, so every response
starts at column P: token-level tensors are response-only, [B, R], entry j belonging to response
token j, and the trainer computes logits for the response positions only (not the prompts',
which for a real vocabulary are most of the logits' memory and time). With shared prompts the
tokens come as each distinct prompt once, [G, P], and the responses, [B, R] (update.forward).

A multi-turn trajectory is one Sample: its response holds the model's turns and, between them,
the environment's observation tokens; `loss_mask` marks the model's (1) against the
environment's (0). The collated `response_mask` [B, R] is that mask (pads 0): every loss, KL,
entropy, advantage and token count reads it, so observation tokens take no part; only
attention reads `response_attention_mask` (every response token, observations included).
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
    # per response token: 1 the model's, 0 the environment's (multi-turn); [] all the model's
    loss_mask: list[int] = field(default_factory=list)
    # multi-turn: model turns, the env's counts summed over its steps (tool_calls, env_seconds,
    # ...), whether a limit cut it, why the env failed, the env's own reward (None: none given)
    turns: int = 1
    env_info: dict = field(default_factory=dict)
    truncated: bool = False
    env_error: str = ""
    env_reward: float | None = None
    trained: bool = True  # False: every token out of the loss (rl.run.collect.mask_untrained)

    @classmethod
    def of(cls, row: int, group: int, prompt_ids: list[int], c: dict, version: int,
           token_versions: bool = False) -> "Sample":
        """The sample of one engine completion (a dict: rollout.vllm_engine.Completion's fields,
        or rollout.stream's, which add per-token versions and the multi-turn fields, among
        them its own prompt: an agent program renders its own)."""
        return cls(row, group, c.get("prompt_ids", prompt_ids), c["token_ids"], c["logprobs"],
                   c["finish_reason"], c["text"], policy_version=(c["versions"][0] if token_versions
                                              and c["versions"] else version),
                   token_versions=c["versions"] if token_versions else [],
                   loss_mask=c.get("loss_mask", []), turns=c.get("turns", 1),
                   env_info=c.get("info", {}), truncated=c.get("truncated", False),
                   env_error=c.get("error", ""), env_reward=c.get("env_reward"))

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the model sampled (what losses, lengths and throughput count)."""
        return sum(self.loss_mask) if self.loss_mask else len(self.response_ids)

    def model_token_mask(self) -> list[int]:
        """The loss mask: 1 for each token the loss counts (the model's, in a trained sample)."""
        if not self.trained:
            return [0] * len(self.response_ids)
        return self.loss_mask or [1] * len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss counts (num_model_tokens, or 0 for a sample that is not trained)."""
        return self.num_model_tokens if self.trained else 0


def right_padded(rows: list[list], width: int, pad, dtype) -> torch.Tensor:
    """[len(rows), width]: each row, then pad (one tensor built from lists: a row at a time
    cost ~6 ms per 256 samples, in the driver, every step)."""
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=dtype)


def left_padded(rows: list[list], width: int, pad, dtype) -> torch.Tensor:
    return torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=dtype)


def collate(samples: list[Sample], pad_id: int, share_prompts: bool = False) -> dict:
    """Padded tensors for one micro-batch (token fields only where every sample has them):
    input_ids/attention_mask/position_ids [B, L] with prompts left-padded and responses
    right-padded; or, with share_prompts, prompt_ids/prompt_attention_mask [G, P] (each
    distinct prompt once, left-padded), prompt_index [B] and response_ids [B, R]; both with
    response_mask and the token fields [B, R]."""
    r_max = max(len(s.response_ids) for s in samples)
    attention = response_attention(samples, r_max)
    masks = {"response_mask": response_mask(samples, r_max),
             "response_attention_mask": attention.float()}
    present = [f for f in TOKEN_FIELDS if all(getattr(s, f) for s in samples)]
    tokens = {f: right_padded([getattr(s, f) for s in samples], r_max, 0.0, torch.float32)
              for f in present}
    if share_prompts:
        return {**_shared_prompt_tokens(samples, pad_id, r_max), **masks, **tokens}
    p_max = max(len(s.prompt_ids) for s in samples)
    prompts = left_padded([s.prompt_ids for s in samples], p_max, pad_id, torch.long)
    responses = right_padded([s.response_ids for s in samples], r_max, pad_id, torch.long)
    prompt_mask = left_padded([[1] * len(s.prompt_ids) for s in samples], p_max, 0, torch.long)
    attention_mask = torch.cat([prompt_mask, attention], 1)
    # positions count real tokens only, as in the rollout engine (left pads do not shift them)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
            "position_ids": position_ids, **masks, **tokens}


def _shared_prompt_tokens(samples: list[Sample], pad_id: int, r_max: int) -> dict:
    rows: dict[tuple, int] = {}  # distinct prompt -> its row, in order of first appearance
    index = [rows.setdefault(tuple(s.prompt_ids), len(rows)) for s in samples]
    p_max = max(len(p) for p in rows)
    return {"prompt_ids": left_padded(list(rows), p_max, pad_id, torch.long),
            "prompt_attention_mask": left_padded([[1] * len(p) for p in rows], p_max, 0,
                                                 torch.long),
            "prompt_index": torch.tensor(index),
            "response_ids": right_padded([s.response_ids for s in samples], r_max, pad_id,
                                         torch.long)}


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
                grad_accum: int, pad_id: int, seed: int, share_prompts: bool = False) -> UpdatePlan:
    """Shuffle, split into mini-batches, then ranks, then exactly `grad_accum` micro-batches.
    With share_prompts the shuffle moves whole groups (as verl's mini-batches of prompts), so
    that a prompt's samples stay together and run their prompt once."""
    if share_prompts:
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        blocks = list(groups.values())
        random.Random(seed).shuffle(blocks)
        order = [s for block in blocks for s in block]
    else:
        order = list(samples)
        random.Random(seed).shuffle(order)
    plan = UpdatePlan([], [])
    for mini in chunk(order, num_mini_batches):
        plan.counts.append(BatchCounts(num_tokens=float(sum(s.num_loss_tokens for s in mini)),
                                       num_seqs=float(len(mini))))
        plan.mini_batches.append([[collate(m, pad_id, share_prompts) for m in micros]
                                  for micros in split_ranks(mini, world_size, grad_accum)])
    return plan


def padded(samples: list[Sample], name: str) -> torch.Tensor:
    """[B, T] response-only token values of `name` (T = the longest response), zero-padded."""
    width = max(len(s.response_ids) for s in samples)
    return right_padded([getattr(s, name) for s in samples], width, 0.0, torch.float32)


def response_attention(samples: list[Sample], width: int | None = None) -> torch.Tensor:
    """[B, R] long: 1 on every response token (the model's and the environment's), 0 on pads."""
    width = max(len(s.response_ids) for s in samples) if width is None else width
    return (torch.arange(width)[None, :] <
            torch.tensor([len(s.response_ids) for s in samples])[:, None]).long()


def response_mask(samples: list[Sample], width: int | None = None) -> torch.Tensor:
    """[B, R] float: 1 on the model's response tokens, 0 on the environment's and on pads."""
    width = max(len(s.response_ids) for s in samples) if width is None else width
    return right_padded([s.model_token_mask() for s in samples], width, 0, torch.float32)


def reduce_rank_metrics(results: list[dict]) -> dict:
    """Ranks return their shares of global means: sum them (maxima: the max); grad norms are
    global already."""
    return {k: (results[0][k] if k == "grad_norm" else
                max(r[k] for r in results) if k in MAX_METRICS else sum(r[k] for r in results))
            for k in results[0]}
