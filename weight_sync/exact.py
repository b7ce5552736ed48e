"""Exact post-sync check where the engine keeps the synced bytes: both sides hash them.

The probe (`weight_sync.verify`) checks what the engine computes; in bfloat16 its tolerance must
cover rounding noise (on SmolLM2-135M 0.25-0.42 nats with a run's probe, 3.1 with
benchmarks/sync_speed.py's), and a stale layer after a small step can hide under it. Where
the engine's parameters hold exactly the bytes the trainer sent (engines that keep their weights
as loaded, `weight_sync.direct`, filled in place), the check can be exact instead: each trainer
rank hashes its ZeRO-3 part of every tensor, cast to the engine's dtype as the sync casts it,
and each engine hashes the same byte ranges of its own parameters.
Each range is one (tensor, trainer rank) pair, so a mismatch names the tensor; a 64-bit XXH3
digest per range (one pass at memory speed, several times faster than zlib's CRC-32).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping

import torch
import xxhash

from weight_sync.buckets import full_shape, tied_head_alias
from weight_sync.in_place import EngineLayout, place_in_engine
from weight_sync.node_buckets import shard_part
from weight_sync.resharding import TPSpec
from weight_sync.verify import SyncVerificationError


@dataclass(frozen=True)
class RangeDigest:
    """XXH3-64 digest of `nbytes` bytes at `offset` of the engine's packed layout
    (`EngineLayout`): trainer rank `rank`'s part of HF tensor `name`."""

    name: str
    rank: int
    offset: int
    nbytes: int
    digest: int


class ExactCheckError(SyncVerificationError):
    """The engine's parameters do not hold the bytes the trainer sent (stops the run, as a
    failed probe does)."""


def digest(data: torch.Tensor) -> int:
    """XXH3-64 of a tensor's bytes (on the host)."""
    flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(flat.cpu().numpy())


def trainer_digests(layout: EngineLayout, spec: TPSpec, module: torch.nn.Module, rank: int,
                    world: int) -> list[RangeDigest]:
    """This rank's part of each trainer tensor at its place in the engine's layout
    (`in_place.place_in_engine`, a tied head at each place it fills), cast to the engine's dtype
    as the sync casts it, hashed."""
    params = dict(module.named_parameters())
    placed, _ = place_in_engine(layout, [(n, full_shape(p)) for n, p in params.items()],
                                tied_head_alias(module), spec)
    out = []
    with torch.no_grad():
        for meta in placed:
            part, start = shard_part(params[meta.name], rank, world)
            if not part.numel():
                continue
            dtype = getattr(torch, meta.dtype)
            size = dtype.itemsize
            out.append(RangeDigest(meta.name, rank, meta.offset + start * size,
                                   part.numel() * size, digest(part.to(dtype))))
    return out


def engine_digests(layout: EngineLayout, params: Mapping[str, torch.Tensor],
                   ranges: list[RangeDigest]) -> list[int]:
    """The digest of each range, read from the engine's own parameters (`params`: vLLM names, as
    `layout` was made from), not from a buffer it may have stopped using."""
    tensors = sorted(layout.tensors, key=lambda m: m.offset)
    starts = [m.offset for m in tensors]
    flat = {m.name: params[m.name].detach().reshape(-1).view(torch.uint8) for m in tensors}
    out = []
    for r in ranges:
        meta = tensors[bisect.bisect_right(starts, r.offset) - 1]
        begin = r.offset - meta.offset
        if begin + r.nbytes > meta.nbytes:
            raise ExactCheckError(f"{r.name}: bytes [{r.offset}, {r.offset + r.nbytes}) run past "
                                  f"engine parameter {meta.name!r}; the layouts differ")
        out.append(digest(flat[meta.name][begin:begin + r.nbytes]))
    return out


def compare(ranges: list[RangeDigest], engine: list[int], where: str) -> int:
    """Raise ExactCheckError naming the first few tensors whose bytes differ; returns the
    number of ranges checked."""
    bad = [r for r, got in zip(ranges, engine, strict=True) if r.digest != got]
    if bad:
        names = ", ".join(sorted({r.name for r in bad})[:4])
        raise ExactCheckError(
            f"{where}: after the weight sync {len(bad)} of {len(ranges)} weight ranges the "
            f"engine holds differ from the trainer's bytes (first: {names}); the engine would "
            f"sample from a stale or corrupted model, so the run stops")
    return len(ranges)
