"""Trainer ranks on one machine assemble each bucket of full weights in shared memory.

ZeRO-3 keeps rank r's part of a parameter as elements [r * s, (r + 1) * s) of the flattened
full parameter (padded at the end). Here every rank writes its own part of each parameter of a
bucket straight to that parameter's place in a shared-memory slot laid out like the wire bucket
(`weight_sync.layout`); after a barrier, every rank on the machine sees the whole bucket. Each
byte is written once, by its owner, all ranks at the same time: no collective carries weights
and nothing is reassembled. (DeepSpeed's all-gather gives every rank a private full copy, at
several times the cost of a memcpy of the bytes.)

Buckets are written in rounds, one barrier each: a round is one bucket, or at TP > 1 one
bucket of each TP rank (`weight_sync.in_place.plan_in_place`). Three rounds of slots rotate:
round j+1 is written while round j is checksummed and put on the wire behind round j-1, still
in flight (with two, the wire stood idle while each bucket was checksummed). The reader of
round j must be done with it before its own rank enters the barrier of round j+2; then no rank
writes round j+3 over it.

Parameters kept whole on every rank (ZeRO-1/2) are split into equal element ranges the same way.

CPU only (the slots are host memory) and one machine only: `NodeBuckets.create` returns None
when the trainer ranks are on several hosts, and the callers gather through the network.
"""
from __future__ import annotations

import mmap
import os
import socket
import tempfile
import uuid
import warnings

import torch

from update.shards import shard_range
from weight_sync.buckets import full_shape, is_world_shard
from weight_sync.layout import TRAILER, BucketMeta, TensorMeta
from weight_sync.resharding import Shard, copy_into_slice


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shard_part(p: torch.nn.Parameter, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """(this rank's elements of the flattened full parameter, where they start in it)."""
    if is_world_shard(p, world):
        size, numel, source = p.ds_tensor.numel(), p.ds_numel, p.ds_tensor.view(-1)
    else:  # whole on every rank: each writes an equal range of its own copy
        if p.numel() == 0:
            raise RuntimeError(
                f"a parameter of shape {list(getattr(p, 'ds_shape', p.shape))} has neither its "
                f"data nor a shard over the whole trainer world (a DeepSpeed hpZ/MiCS or "
                f"offloaded partition?), so it cannot be written to shared memory; turn those "
                f"DeepSpeed options off, or run the trainer ranks on several hosts (gathers)")
        numel = p.numel()
        size = -(-numel // world)
        source = p.data.reshape(-1)[rank * size:]
    start, count = shard_range(rank, size, numel)
    return source[:count], start


def write_shards(memory: torch.Tensor, tensors: list[TensorMeta],
                 params: list[torch.nn.Parameter], rank: int, world: int) -> int:
    """Write this rank's part of each parameter to its tensor's place in `memory` (a uint8
    buffer), viewed in the tensor's dtype (the copy casts); a tensor that is a TP rank's slice
    (`meta.shard`) gets those of the part's elements that lie in the slice. Returns the elements
    written."""
    written = 0
    for p, meta in zip(params, tensors, strict=True):
        part, start = shard_part(p, rank, world)
        full = memory[meta.offset:meta.offset + meta.nbytes].view(getattr(torch, meta.dtype))
        if meta.shard is None:
            full[start:start + part.numel()].copy_(part)
            written += part.numel()
            continue
        shape = full_shape(p)
        dim, first, length = meta.shard
        written += copy_into_slice(part, start, shape[1] if len(shape) > 1 else 1,
                                   Shard(dim, first, length, length),
                                   full.view(meta.shape[0] if meta.shape else 1, -1), 0)
    return written


def same_host() -> bool:
    """Whether every rank of the default process group runs on this host (collective)."""
    import torch.distributed as dist

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts)) == 1


def _create(path: str, nbytes: int) -> bool:
    """Create the file with all its pages reserved; False if that fails (a container's default
    /dev/shm is 64 MB: pages that are not there would kill the process with SIGBUS on first
    touch; or the directory is not writable)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # e.g. containers that share a host name but not /dev/shm
        return None
    try:
        return mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)


def shared_memory(nbytes: int) -> tuple[mmap.mmap, torch.Tensor] | None:
    """`nbytes` of zeroed memory mapped by every rank of the default process group (collective;
    call `same_host()` first), or None on every rank if some rank could not have it (with a
    warning). The file is unlinked at once: the memory lives until the last mapping goes, so
    nothing is left when a process dies."""
    import torch.distributed as dist

    rank = dist.get_rank()
    name = [None]
    if rank == 0:
        path = os.path.join(_shm_dir(), f"rlstack-sync-{uuid.uuid4().hex}")
        name = [path if _create(path, nbytes) else None]
    dist.broadcast_object_list(name, src=0)
    path = name[0]
    mapping = None if path is None else _map(path, nbytes)
    ok = torch.tensor([int(mapping is not None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank mapped it, or nobody uses it
    if rank == 0 and path is not None:
        os.unlink(path)
    if not int(ok):
        if rank == 0:
            warnings.warn(f"could not share {nbytes / 2**20:.0f} MiB through {_shm_dir()}; "
                          f"weight syncs gather instead (give the container a larger /dev/shm)")
        return None
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


class NodeBuckets:
    """`ROUNDS` x `per_round` shared-memory slots of `slot_bytes`, mapped by every trainer rank
    of one machine; bucket k goes to slot k % (ROUNDS * per_round)."""

    ROUNDS = 3

    def __init__(self, slot_bytes: int, per_round: int, mapped: tuple[mmap.mmap, torch.Tensor]):
        import torch.distributed as dist

        self.slot_bytes, self.per_round = slot_bytes, per_round
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._map, memory = mapped
        self.slots = [memory[i * slot_bytes:(i + 1) * slot_bytes]
                      for i in range(self.ROUNDS * per_round)]

    @classmethod
    def create(cls, slot_bytes: int, per_round: int = 1) -> NodeBuckets | None:
        """Collective over the default process group (the trainer world): every rank calls it.
        None when the ranks are not all on this host, or the slots do not fit in memory."""
        nbytes = cls.ROUNDS * per_round * slot_bytes
        mapped = shared_memory(nbytes) if same_host() else None
        return cls(slot_bytes, per_round, mapped) if mapped is not None else None

    @classmethod
    def reuse(cls, current: NodeBuckets | None | bool, slot_bytes: int, per_round: int = 1):
        """`current` if it has enough slots big enough, else new ones (collective; every rank
        decides alike from the same layout). False stays False: ranks on several hosts."""
        if current is False or (current is not None and current.slot_bytes >= slot_bytes
                                and current.per_round >= per_round):
            return current
        return cls.create(slot_bytes, per_round) or False

    def write(self, index: int, bucket: BucketMeta, params: list[torch.nn.Parameter]
              ) -> torch.Tensor:
        """Write this rank's parts of bucket `index` into its slot; returns the slot's
        nbytes + TRAILER bytes, whole only after the `publish()` that ends its round."""
        if bucket.nbytes + TRAILER > self.slot_bytes:
            raise ValueError(f"bucket of {bucket.nbytes} bytes does not fit a slot of "
                             f"{self.slot_bytes}; create the NodeBuckets from this layout")
        slot = self.slots[index % len(self.slots)][:bucket.nbytes + TRAILER]
        if self.rank == 0:  # the gaps (alignment, padding rows): defined bytes for checksums
            end = 0
            for meta in bucket.tensors:
                slot[end:meta.offset].zero_()
                end = meta.offset + meta.nbytes
            slot[end:bucket.nbytes].zero_()
        # in the layout's dtype: the engine's own for in-place buckets
        write_shards(slot, bucket.tensors, params, self.rank, self.world)
        return slot

    @staticmethod
    def publish() -> None:
        """Every rank has written its parts of round j (and is done reading round j-2)."""
        import torch.distributed as dist

        dist.barrier()
