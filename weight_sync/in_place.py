"""Disaggregated syncs that land in place: buckets cut from the engine's own packed weights.

A CPU rollout engine that keeps its weights as loaded (see `weight_sync.direct`) packs them into
one flat buffer (`EngineLayout`: each distinct parameter at a 64-byte aligned offset, in vLLM's
layout: fused q/k/v and gate/up, padded vocab) and points its parameters at it. The trainer
ranks get that layout once and, when they share one CPU host (the buckets are assembled in its
shared memory, `NodeBuckets`), cut buckets that tile the buffer: bucket k is the byte range
[start_k, start_k+1), holding each HF tensor at its slot (`local_param_slot`) in the engine's
dtype, zeros in the gaps (alignment, the vocab's padding rows, which vLLM keeps zero). Every
engine then receives bucket k straight into its parameters: no receive buffer, no copy.

The bucket's 8-byte checksum trailer lands on the first bytes of bucket k+1 (or the spare
bytes after the last bucket); the receiver reads it before asking for bucket k+1.

A tensor-parallel engine's ranks each keep their weights in a file of shared memory laid out
the same way (`weight_sync.tp_shared`). Its buckets tile each rank's buffer in turn (a bucket's
`rank` says whose): a tensor there is the rank's slice of an HF tensor (`TensorMeta.shard`), and
each trainer rank writes the elements of its shard that lie in it (`node_buckets.write_shards`).
The engine's actor receives every bucket straight into its rank's memory.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch

from weight_sync.buckets import names_for
from weight_sync.direct import RELOAD_HINT, DirectLoadError
from weight_sync.layout import TRAILER, BucketMeta, TensorMeta, dtype_name
from weight_sync.resharding import TPSpec, local_param_slot, sent_rows, shard_range

ALIGN = 64  # bytes: each parameter starts on a cache line


@dataclass
class EngineLayout:
    """The engine's distinct parameters in its packed buffer, and its other names for them."""

    tensors: list[TensorMeta]
    aliases: dict[str, str] = field(default_factory=dict)  # engine name -> stored name
    nbytes: int = 0

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> EngineLayout:
        return cls.of_described([(name, list(p.shape), dtype_name(p.dtype), p.data_ptr())
                                 for name, p in params.items()])

    @classmethod
    def of_described(cls, params: list[tuple[str, list[int], str, int]]) -> EngineLayout:
        """From (name, shape, dtype, storage key) of each parameter, in order: names whose key
        was seen before are aliases (a tied head). E.g. a TP rank's, from another process."""
        first: dict[int, str] = {}
        tensors, aliases, end = [], {}, 0
        for name, shape, dtype, key in params:
            if key in first:
                aliases[name] = first[key]
                continue
            first[key] = name
            meta = TensorMeta(name, list(shape), dtype, end)
            tensors.append(meta)
            end += -(-meta.nbytes // ALIGN) * ALIGN
        return cls(tensors, aliases, end)

    def offsets(self) -> dict[str, int]:
        """{every engine name, aliases included: its byte offset}."""
        out = {m.name: m.offset for m in self.tensors}
        out.update({alias: out[stored] for alias, stored in self.aliases.items()})
        return out

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(data: str) -> EngineLayout:
        raw = json.loads(data)
        return EngineLayout([TensorMeta(**t) for t in raw["tensors"]], raw["aliases"],
                            raw["nbytes"])

    def digest(self) -> str:
        return hashlib.sha256(self.encode().encode()).hexdigest()[:16]

    def views(self, memory: torch.Tensor) -> dict[str, torch.Tensor]:
        """{every engine name: its tensor in `memory`} (a uint8 buffer of at least nbytes)."""
        views = {}
        for meta in self.tensors:
            view = memory[meta.offset:meta.offset + meta.nbytes].view(getattr(torch, meta.dtype))
            views[meta.name] = view.view(meta.shape)
        views.update({alias: views[stored] for alias, stored in self.aliases.items()})
        return views

    def pack(self, params: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """(flat buffer holding the current values, `views` into it); the buffer has TRAILER
        spare bytes at the end for the last bucket's checksum."""
        device = next(iter(params.values())).device
        flat = torch.zeros(self.nbytes + TRAILER, dtype=torch.uint8, device=device)
        views = self.views(flat)
        for meta in self.tensors:
            views[meta.name].copy_(params[meta.name])
        return flat, views

    def sent_numel(self, spec: TPSpec, tp_rank: int = 0) -> int:
        """Elements a sync fills (in TP rank tp_rank): everything but the vocab's padding rows."""
        total = 0
        for m in self.tensors:
            rows = m.shape[0] if m.shape else 1
            numel = m.nbytes // getattr(torch, m.dtype).itemsize
            total += sent_rows(m.name, rows, spec, tp_rank) * (numel // rows)
        return total


def place_in_engine(engine: EngineLayout, trainer: list[tuple[str, list[int]]],
                    trainer_aliases: Mapping[str, str], spec: TPSpec, tp_rank: int = 0
                    ) -> tuple[list[TensorMeta], dict[str, int]]:
    """Each HF tensor (named as the trainer names it; shape as sent, dtype as stored) at its
    byte offset in the engine's buffer (at TP > 1: TP rank tp_rank's slice of it, in that
    rank's buffer), a tied head once; and the bytes each stored parameter gets. A tensor
    without a place, or that does not fit it, is an error."""
    stored = {m.name: m for m in engine.tensors}
    placed: list[TensorMeta] = []
    covered: dict[str, int] = {}
    for name, shape in trainer:
        seen = set()
        for target_name in names_for(name, dict(trainer_aliases)):
            target, row = local_param_slot(target_name, spec)
            target = engine.aliases.get(target, target)
            meta = stored.get(target)
            if meta is None:
                raise DirectLoadError(f"{target_name!r} goes to engine parameter {target!r}, "
                                      f"which the engine does not have; {RELOAD_HINT}")
            if target in seen:  # a head the engine ties too
                continue
            seen.add(target)
            row_bytes = meta.nbytes // meta.shape[0] if meta.shape else meta.nbytes
            sent = TensorMeta(name, list(shape), meta.dtype, meta.offset + row * row_bytes)
            if spec.tp_size > 1:
                shard = shard_range(target_name, tuple(shape), spec, tp_rank)
                if shard.length == 0:  # a vocab slice past the real rows: all padding
                    continue
                sent.shape[shard.dim] = shard.length
                sent.shard = [shard.dim, shard.start, shard.length]
            if row * row_bytes + sent.nbytes > meta.nbytes or sent.shape[1:] != meta.shape[1:]:
                raise DirectLoadError(f"{target_name!r} {sent.shape} does not fit engine "
                                      f"parameter {target!r} {meta.shape} at row {row}")
            placed.append(sent)
            covered[target] = covered.get(target, 0) + sent.nbytes
    return placed, covered


def plan_in_place(engines: list[EngineLayout], trainer: list[tuple[str, list[int]]],
                  trainer_aliases: Mapping[str, str], spec: TPSpec, bucket_bytes: int
                  ) -> list[BucketMeta]:
    """Buckets that tile the engine's buffer, each TensorMeta an HF tensor or its slice (see
    `place_in_engine`) at its offset in its bucket; every byte but the padding covered.

    At TP > 1 (`engines` by TP rank) each rank's buffer is cut into buckets, taken in rounds:
    rank 0's bucket j, rank 1's bucket j, ...; the trainer ranks write a round before one
    barrier (`weight_sync.transport.rounds`). Bucket by bucket, one trainer rank wrote while
    the other waited: the rows of a column-parallel slice lie in one trainer rank's ZeRO-3
    shard (docs/benchmarks.md#tensor-parallel-engines)."""
    per_rank = [_plan_rank(engine, trainer, trainer_aliases, spec, bucket_bytes, rank)
                for rank, engine in enumerate(engines)]
    return [buckets[j] for j in range(max(map(len, per_rank)))
            for buckets in per_rank if j < len(buckets)]


def _plan_rank(engine: EngineLayout, trainer: list[tuple[str, list[int]]],
               trainer_aliases: Mapping[str, str], spec: TPSpec, bucket_bytes: int,
               tp_rank: int) -> list[BucketMeta]:
    placed, covered = place_in_engine(engine, trainer, trainer_aliases, spec, tp_rank)
    for meta in engine.tensors:
        rows = meta.shape[0] if meta.shape else 1
        want = meta.nbytes // rows * sent_rows(meta.name, rows, spec, tp_rank)
        if covered.get(meta.name, 0) != want:
            raise DirectLoadError(f"the trainer's tensors cover {covered.get(meta.name, 0)} of "
                                  f"the {want} bytes of engine parameter {meta.name!r}; the "
                                  f"trainer and engine models differ")
    placed.sort(key=lambda sent: sent.offset)
    buckets: list[BucketMeta] = []
    start, current = 0, []
    for sent in placed:
        offset = sent.offset
        # cut only at 8-byte boundaries: the checksum reads a bucket as 64-bit words
        if current and offset + sent.nbytes - start > bucket_bytes and offset % 8 == 0:
            buckets.append(BucketMeta(current, offset - start, start, tp_rank))
            start, current = offset, []
        sent.offset = offset - start
        current.append(sent)
    if current:
        buckets.append(BucketMeta(current, engine.nbytes - start, start, tp_rank))
    return buckets


def layouts_digest(engines: list[EngineLayout]) -> str:
    """The digest in-place buckets name the engine by (its TP ranks' layouts together)."""
    if len(engines) == 1:
        return engines[0].digest()
    return hashlib.sha256("|".join(e.digest() for e in engines).encode()).hexdigest()[:16]


def encode_layouts(engines: list[EngineLayout]) -> str:
    """An engine's packed layout, or its TP ranks' (by rank), for the trainer ranks."""
    return engines[0].encode() if len(engines) == 1 else json.dumps(
        {"tp_ranks": [e.encode() for e in engines]})


def decode_layouts(encoded: str) -> list[EngineLayout]:
    raw = json.loads(encoded)
    if "tp_ranks" in raw:
        return [EngineLayout.decode(e) for e in raw["tp_ranks"]]
    return [EngineLayout.decode(encoded)]
