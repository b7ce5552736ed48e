"""One interface for moving a policy version from the trainer ranks into rollout engines.

`send(module, version)` runs on every trainer rank (assembling a bucket is collective);
`receive(load_weights, version)` runs beside each engine, with its `load_weights(iterator of
(name, tensor))`. Two transports implement it:

- `LocalTransport` (colocated, when the engines cannot share one copy of their weights, see
  `weight_sync.shared_weights`): the engine lives in the trainer's process and reads each bucket
  straight from the trainer's iterator: assembled in shared memory by the ranks of one CPU host
  (`NodeBuckets`), else gathered by DeepSpeed.
- `BroadcastTransport` (disaggregated): trainer rank 0 broadcasts over a `CollectiveGroup` to
  every engine: one `SyncLayout` message, then flat checksummed buckets back to back,
  assembling bucket k+1 while bucket k is on the wire. Buckets cut from the engines' packed
  layout land straight in their parameters (`weight_sync.in_place`). No per-parameter call, no
  disk.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
import time
from typing import Callable, Iterable, Iterator

import torch

from weight_sync.buckets import (SyncStats, full_shape, gathered, iter_full_weights, names_for,
                                 tied_head_alias)
from weight_sync.checksums import get_checksum
from weight_sync.collective import CollectiveGroup
from weight_sync.in_place import EngineLayout, layouts_digest, plan_in_place
from weight_sync.layout import (TRAILER, SyncLayout, as_int64, flatten_into, new_buffer,
                                plan_layout, read_trailer, unflatten, write_trailer)
from weight_sync.node_buckets import NodeBuckets
from weight_sync.resharding import TPSpec
from weight_sync.shard_gather import ShardGather, shards_to_rank0

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class WeightSyncError(RuntimeError):
    """A sync did not deliver the policy version it was asked for (corrupted bucket, version
    mismatch); the engine is marked stale and must not generate until a good sync."""


class WeightTransport(ABC):
    @abstractmethod
    def send(self, module: torch.nn.Module, version: int) -> SyncStats:
        """Offer the module's weights as policy `version` (every trainer rank calls this)."""

    @abstractmethod
    def receive(self, load_weights: LoadWeights, version: int) -> SyncStats:
        """Load policy `version` into an engine; raises WeightSyncError if it did not arrive."""


class LocalTransport(WeightTransport):
    """Colocated: `send` prepares a lazy bucketed iterator, `receive` (same process) drains it
    into the engine, so at most one bucket of gathered weights exists at a time (three slots with
    `shared`).

    `shared`: trainer ranks on one CPU machine assemble buckets in shared memory
    (`NodeBuckets`; None: create them on first use; False: never, DeepSpeed gathers). Its
    tensors are views, valid until the next bucket: a loader that keeps views (vLLM's reload)
    needs `keeps_views=True`, which hands out copies.
    """

    def __init__(self, bucket_bytes: int, shared: NodeBuckets | None | bool = None,
                 keeps_views: bool = False):
        self.bucket_bytes, self.shared, self.keeps_views = bucket_bytes, shared, keeps_views
        self._pending: tuple[int, Iterator, SyncStats] | None = None

    def send(self, module: torch.nn.Module, version: int) -> SyncStats:
        stats = SyncStats()
        aliases = tied_head_alias(module)
        layout = _plan(module, self.bucket_bytes, version, "none", aliases)
        self.shared = _shared_slots(self.shared, module, layout, alone_too=False)
        if self.shared:
            weights = _node_weights(module, layout, self.shared, stats, self.keeps_views)
        else:
            weights = iter_full_weights(module, self.bucket_bytes, aliases, stats)
        self._pending = (version, weights, stats)
        return stats  # filled in while receive() consumes the iterator

    def receive(self, load_weights: LoadWeights, version: int) -> SyncStats:
        if self._pending is None or self._pending[0] != version:
            sent = None if self._pending is None else self._pending[0]
            raise WeightSyncError(f"asked to load policy version {version}, the trainer offered "
                                  f"{sent}: call send() with the same version first")
        _, weights, stats = self._pending
        self._pending = None
        t0 = time.perf_counter()
        load_weights(weights)
        stats.add_time("load", time.perf_counter() - t0 - stats.seconds.get("gather", 0.0))
        return stats


def _plan(module: torch.nn.Module, bucket_bytes: int, version: int, checksum: str,
          aliases: dict[str, str]) -> SyncLayout:
    return plan_layout([(n, full_shape(p), p.dtype) for n, p in module.named_parameters()],
                       bucket_bytes, version, checksum, aliases)


def _shared_slots(shared: NodeBuckets | None | bool, module: torch.nn.Module,
                  layout: SyncLayout, alone_too: bool = True):
    """Shared-memory slots for this layout on a CPU trainer, else False (collective).
    `alone_too=False`: not for a single rank, whose parameters are already whole."""
    dist = torch.distributed
    if shared is False or not layout.buckets or not dist.is_initialized() \
            or next(module.parameters()).device.type != "cpu" \
            or (not alone_too and dist.get_world_size() == 1):
        return False
    return NodeBuckets.reuse(shared, max(b.nbytes for b in layout.buckets) + TRAILER,
                             max(map(len, rounds(layout.buckets))))


def _with_aliases(pairs, aliases: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pairs:
        for each in names_for(name, aliases):
            yield each, tensor


def _node_weights(module: torch.nn.Module, layout: SyncLayout, shared: NodeBuckets,
                  stats: SyncStats, copy: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) bucket by bucket from shared memory; every trainer rank iterates
    it to the end (each bucket ends in a barrier)."""
    by_name = dict(module.named_parameters())
    for index, bucket in enumerate(layout.buckets):
        t0 = time.perf_counter()
        slot = shared.write(index, bucket, [by_name[m.name] for m in bucket.tensors])
        shared.publish()
        stats.add_time("gather", time.perf_counter() - t0)
        stats.add_bucket(sum(m.nbytes for m in bucket.tensors), len(bucket.tensors))
        views = unflatten(slot, bucket)
        yield from _with_aliases(((n, t.clone() if copy else t) for n, t in views),
                                 layout.aliases)


class BroadcastTransport(WeightTransport):
    """Disaggregated: trainer rank 0 (group rank 0) broadcasts to every engine in `group`.
    Trainer ranks without a group only take part in assembling the buckets: in shared memory
    when they share one CPU machine (`shared`, as in `LocalTransport`), else by gathering
    shards to rank 0 (`ShardGather`) or with DeepSpeed."""

    def __init__(self, group: CollectiveGroup | None, bucket_bytes: int, checksum: str = "sum64",
                 shared: NodeBuckets | None | bool = None,
                 engine: tuple[list[EngineLayout], TPSpec] | None = None):
        """`engine`: the engines' packed layout (all alike; at TP > 1 each rank's, by rank) and
        their TP spec; with shared slots, buckets are then cut from it and land in the engines'
        parameters (`weight_sync.in_place`)."""
        self.group, self.bucket_bytes, self.checksum = group, bucket_bytes, checksum
        self._checksum = get_checksum(checksum)
        self.shared, self.engine = shared, engine
        self.in_place = False  # whether the last send cut its buckets from the engine layout

    def _layout(self, module: torch.nn.Module, version: int) -> SyncLayout:
        """In-place buckets when the engines' layout is known and the ranks share memory; else
        buckets of the trainer's own tensors (collective: every rank decides alike)."""
        aliases = tied_head_alias(module)
        if self.engine is not None and self.shared is not False:
            engines, spec = self.engine
            trainer = [(n, full_shape(p)) for n, p in module.named_parameters()]
            buckets = plan_in_place(engines, trainer, aliases, spec, self.bucket_bytes)
            layout = SyncLayout(version, self.checksum, buckets, {}, layouts_digest(engines))
            self.shared = _shared_slots(self.shared, module, layout)
            self.in_place = bool(self.shared)
            if self.in_place:
                return layout
        layout = _plan(module, self.bucket_bytes, version, self.checksum, aliases)
        self.shared = _shared_slots(self.shared, module, layout)
        return layout

    def send(self, module: torch.nn.Module, version: int) -> SyncStats:
        by_name = dict(module.named_parameters())
        layout = self._layout(module, version)
        group = self.group
        if group is not None:
            group.broadcast_bytes(layout.encode())
        stats = SyncStats()
        in_flight: deque = deque()  # (round, broadcast) not yet waited for, oldest first
        shard_gather = None
        if group is not None and layout.buckets and not self.shared:
            # reused buffers: bucket k is filled while buckets k-1 and k-2 are on the wire
            # (fresh memory for every bucket paid a page fault per 4 KiB, ~0.2 s per 400 MB)
            size = max(b.nbytes for b in layout.buckets) + TRAILER
            pool = [torch.empty(size, dtype=torch.uint8, device=group.device)
                    for _ in range(NodeBuckets.ROUNDS)]
        plan = rounds(layout.buckets)
        for j, members in enumerate(plan):
            t0 = time.perf_counter()
            if self.shared:
                buffers = [self.shared.write(k, layout.buckets[k],
                                             [by_name[m.name] for m in layout.buckets[k].tensors])
                           for k in members]
                # past this barrier the other ranks write round j+1 over round j-2's slots
                t0 += _wait_until(in_flight, j - 1, stats)
                self.shared.publish()
            else:  # one bucket a round (the trainer's own layout)
                (k,) = members
                buffers = [None]
                if group is not None:  # this buffer held bucket k-ROUNDS
                    t0 += _wait_until(in_flight, k - NodeBuckets.ROUNDS + 1, stats)
                    buffers = [pool[k % len(pool)][:layout.buckets[k].nbytes + TRAILER]]
                shard_gather = _assemble(layout.buckets[k],
                                         [by_name[m.name] for m in layout.buckets[k].tensors],
                                         buffers[0], shard_gather)
            if group is None:
                continue
            for k, buffer in zip(members, buffers):
                in_flight.append((j, self._post(buffer, layout.buckets[k], t0, stats)))
                t0 = time.perf_counter()  # the round's assembly counts once
        _wait_until(in_flight, len(plan), stats)  # every round
        return stats

    def _post(self, buffer: torch.Tensor, bucket, t0: float, stats: SyncStats):
        """Checksum the assembled bucket into its trailer and queue it on the wire behind the
        buckets still in flight; returns its broadcast's work."""
        t1 = time.perf_counter()
        write_trailer(buffer, bucket, self._checksum(buffer[:bucket.nbytes]))
        t2 = time.perf_counter()
        work = self.group.broadcast(buffer)
        stats.add_time("gather", t1 - t0)
        stats.add_time("checksum", t2 - t1)
        stats.add_time("wire", time.perf_counter() - t2)
        stats.add_bucket(bucket.nbytes, len(bucket.tensors))
        return work

    def receive(self, load_weights: LoadWeights, version: int, keeps_views: bool = True,
                packed: tuple[str, torch.Tensor] | None = None) -> SyncStats:
        """`keeps_views=False`: the loader copies each tensor before asking for the next (as
        `DirectLoad` does), so two receive buffers are reused; vLLM's reload keeps views until
        a layer is complete, so by default every bucket gets fresh memory.
        `packed`: (layout digest, flat buffer) of an engine whose parameters live in one buffer
        (`EngineLayout.pack`), or (digest, [buffer of each TP rank]): in-place buckets are
        received straight into it."""
        layout = SyncLayout.decode(self.group.broadcast_bytes(None))
        errors: list[str] = []
        in_place = _check_layout(layout, version, packed, errors)
        stats = SyncStats()
        pool = []
        if not keeps_views and not in_place and layout.buckets:
            size = max(b.nbytes for b in layout.buckets) + TRAILER
            pool = [torch.empty(size, dtype=torch.uint8, device=self.group.device)
                    for _ in range(2)]
        weights = self._stream(layout, in_place, packed, pool, stats, errors)
        t0 = time.perf_counter()
        try:
            if not errors and not layout.in_place:
                load_weights(weights)
                stats.add_time("load", time.perf_counter() - t0 - sum(stats.seconds.values()))
        except Exception as e:
            if not errors:
                raise
            # a bad bucket's tensors were skipped; the loader's complaint follows from that
            errors.append(f"then the engine's loader failed: {e}")
        finally:
            for _ in weights:  # drain what the engine did not take, or the sender would hang
                pass
        if errors:
            raise WeightSyncError(
                f"weight sync to policy version {version} failed on this engine: "
                + "; ".join(errors) + ". The engine is marked stale; sync again before generating.")
        return stats

    def _stream(self, layout: SyncLayout, in_place: bool, packed, pool: list, stats: SyncStats,
                errors: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every bucket that passes its checksum, bucket k+1 on the wire while
        bucket k is checked and loaded; a failed bucket's tensors are skipped and reported."""
        group, check = self.group, get_checksum(layout.checksum)

        def post(k: int):
            bucket = layout.buckets[k]
            if in_place:  # its trailer lands on the first bytes of its TP rank's next
                # bucket (k+1 at TP 1, k+TP at TP > 1): read before that is posted
                memory = packed[1][bucket.rank] if isinstance(packed[1], list) else packed[1]
                buffer = memory[bucket.start:bucket.start + bucket.nbytes + TRAILER]
            else:
                buffer = (pool[k % 2][:bucket.nbytes + TRAILER] if pool
                          else new_buffer(bucket, group.device))
            return buffer, group.broadcast(buffer)

        pending = post(0) if layout.buckets else None
        for k, bucket in enumerate(layout.buckets):
            buffer, work = pending
            t0 = time.perf_counter()
            work.wait()
            # in place, its rank's next bucket overwrites this trailer; elsewhere reading it before
            # posting k+1 would make a GPU wait before the next broadcast is queued
            sent = read_trailer(buffer, bucket) if in_place else None
            pending = post(k + 1) if k + 1 < len(layout.buckets) else None  # next on the wire
            t1 = time.perf_counter()
            sent = read_trailer(buffer, bucket) if sent is None else sent
            got = as_int64(check(buffer[:bucket.nbytes]))
            stats.add_time("wire", t1 - t0)
            stats.add_time("checksum", time.perf_counter() - t1)
            if sent != got:
                names = [m.name for m in bucket.tensors]
                errors.append(f"bucket {k}/{len(layout.buckets)} ({bucket.nbytes} bytes: "
                              f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) "
                              f"failed its {layout.checksum} check: sent {sent:#x}, "
                              f"received {got:#x}")
                continue
            stats.add_bucket(bucket.nbytes, len(bucket.tensors))
            stats.rank_bytes[bucket.rank] = stats.rank_bytes.get(bucket.rank, 0) + bucket.nbytes
            if not layout.in_place:  # in place: already where the engine reads it
                yield from _with_aliases(unflatten(buffer, bucket), layout.aliases)


def rounds(buckets: list) -> list[list[int]]:
    """The bucket indices of each round the trainer ranks write before one barrier: a bucket
    alone, or in-place buckets of TP ranks 0, 1, ... in turn (`plan_in_place`)."""
    out: list[list[int]] = []
    for k, bucket in enumerate(buckets):
        if out and bucket.rank > buckets[out[-1][-1]].rank:
            out[-1].append(k)
        else:
            out.append([k])
    return out


def _wait_until(in_flight: deque, first: int, stats: SyncStats) -> float:
    """Wait for the broadcasts of every round before `first`; the seconds waited count as wire
    time."""
    t0 = time.perf_counter()
    while in_flight and in_flight[0][0] < first:
        in_flight.popleft()[1].wait()
    waited = time.perf_counter() - t0
    stats.add_time("wire", waited)
    return waited


def _assemble(bucket, params: list[torch.nn.Parameter], buffer: torch.Tensor | None,
              shard_gather: ShardGather | None) -> ShardGather | None:
    """Every trainer rank calls this for the same bucket; rank 0's `buffer` (None on ranks
    without a group) gets its full tensors: shards gathered to rank 0 (`ShardGather`, made on
    first use and returned for the next bucket), else DeepSpeed's all-gather."""
    if shards_to_rank0(params):
        shard_gather = shard_gather or ShardGather()
        shard_gather.gather(params, buffer, bucket)
    else:
        with gathered(params):
            if buffer is not None:
                flatten_into(buffer, bucket, [p.data for p in params])
    return shard_gather


def _check_layout(layout: SyncLayout, version: int, packed, errors: list[str]) -> bool:
    """Whether the buckets land in place in the engine's packed buffer; what does not fit (a
    wrong version, another engine layout) goes to `errors`, the buckets still received."""
    if layout.version != version:
        errors.append(f"the trainer sent policy version {layout.version}, this engine was "
                      f"told to expect {version}")
    in_place = bool(layout.in_place)
    if in_place and (packed is None or packed[0] != layout.in_place):
        errors.append(f"the trainer cut buckets for engine layout {layout.in_place}, this "
                      f"engine's is {packed[0] if packed else 'not packed'}: the engines "
                      f"were restarted or differ; start them through the placement's "
                      f"init_rollout, which packs every engine and tells the trainers")
        in_place = False  # receive into scratch memory, so the sender can finish
    return in_place
