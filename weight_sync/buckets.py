"""Gather a (possibly ZeRO-3 sharded) module's parameters in buckets of bounded size.

The sending side of every sync: an iterator of (HF name, full tensor). Under ZeRO-3 each bucket
is gathered with `deepspeed.zero.GatheredParameters` (a collective: every rank iterates the same
plan in the same order) and handed out, so at most one bucket of full weights exists at a time.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch


def full_numel(p: torch.nn.Parameter) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3 keeps the full size here


def full_shape(p: torch.nn.Parameter) -> list[int]:
    return list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape)  # ZeRO-3 keeps it here


def is_world_shard(p: torch.nn.Parameter, world: int) -> bool:
    """A ZeRO-3 parameter whose `ds_tensor` is this rank's equal part of the whole trainer
    world (DeepSpeed pads the flattened tensor to world parts; not hpZ/MiCS sub-groups)."""
    ds = getattr(p, "ds_tensor", None)
    return ds is not None and ds.numel() * world == getattr(p, "ds_numel_aligned", -1)


def names_for(name: str, aliases: dict[str, str]) -> list[str]:
    """`name` and every alias that stands for it (see `tied_head_alias`)."""
    return [name] + [alias for alias, source in aliases.items() if source == name]


def plan_buckets(named_params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int):
    """Split parameters, in order, into buckets of at most bucket_bytes (a larger tensor alone)."""
    buckets, current, size = [], [], 0
    for name, p in named_params:
        nbytes = full_numel(p) * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass
class SyncStats:
    num_buckets: int = 0
    num_tensors: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    names: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # time per phase (gather, wire, ...)
    rank_bytes: dict[int, int] = field(default_factory=dict)  # in place at TP > 1: per TP rank

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def add_bucket(self, nbytes: int, num_tensors: int) -> None:
        """Count one bucket that arrived (or was sent) whole."""
        self.num_buckets += 1
        self.num_tensors += num_tensors
        self.bytes += nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, nbytes)


def gathered(params: list[torch.nn.Parameter]):
    """A context in which ZeRO-3 parameters are whole on every rank (a collective: every rank
    enters it with the same list); nothing to do for unsharded parameters."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def tied_head_alias(module: torch.nn.Module) -> dict[str, str]:
    """{"lm_head.weight": <embedding name>} for tied embeddings: the head is no separate
    parameter, yet vLLM keeps its own copy, which must be sent or it silently keeps the old one."""
    if not getattr(getattr(module, "config", None), "tie_word_embeddings", False):
        return {}
    names = [n for n, _ in module.named_parameters() if n.endswith("embed_tokens.weight")]
    return {"lm_head.weight": names[0]} if names else {}


def iter_full_weights(module: torch.nn.Module, bucket_bytes: int, aliases: dict[str, str],
                      stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter, gathering one bucket at a time, and each
    alias (extra name -> parameter name, see `tied_head_alias`) right after its parameter.

    The tensors are the gathered parameters themselves, not copies (a copy of a 400 MB model
    into fresh memory cost ~0.2 s here): the consumer copies what it keeps and never writes into
    them. They stay valid after their bucket is released, because ZeRO-3 frees a gathered
    parameter by pointing it at an empty tensor, not by freeing memory still referenced.
    """
    stats = stats if stats is not None else SyncStats()
    for bucket in plan_buckets(list(module.named_parameters()), bucket_bytes):
        t0 = time.perf_counter()
        with gathered([p for _, p in bucket]):
            out = [(name, p.data.detach()) for name, p in bucket]
        stats.add_time("gather", time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for _, t in out)
        stats.num_buckets += 1
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
        for name, tensor in out:
            stats.num_tensors += 1
            stats.bytes += tensor.numel() * tensor.element_size()
            for each in names_for(name, aliases):
                stats.names.append(each)
                yield each, tensor
