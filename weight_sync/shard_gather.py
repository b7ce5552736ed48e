"""Gathering ZeRO-3 shards to trainer rank 0 alone, for the broadcast sync (weight_sync.transport):
which buckets qualify, and the gather straight into the send buffer."""
from __future__ import annotations

import torch

from update.shards import shard_range
from weight_sync.buckets import is_world_shard


def shards_to_rank0(params: list[torch.nn.Parameter]) -> bool:
    """True when the bucket's parameters are ZeRO-3 shards over the whole trainer world, on the
    compute device, in one dtype: then rank 0 can gather them itself (`ShardGather`).
    Every rank answers alike (it reads the same metadata); otherwise DeepSpeed gathers."""
    import torch.distributed as dist

    if not dist.is_initialized() or not params:
        return False
    world = dist.get_world_size()
    first = params[0]
    return all(is_world_shard(p, world) and p.ds_tensor.device == first.ds_tensor.device
               and p.dtype == first.dtype for p in params)


class ShardGather:
    """Gathers ZeRO-3 shards to trainer rank 0 only, straight into its places in the send buffer.

    `deepspeed.zero.GatheredParameters` all-gathers whole parameters onto every rank; the
    broadcast needs them on rank 0 alone. Here the other ranks only send their shard, and rank 0
    writes each element once (`update.shards.shard_range`), into the buffer that goes on the
    wire. Scratch space is kept across buckets (grown when a bucket needs more)."""

    def __init__(self):
        import torch.distributed as dist

        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.local = self.recv = None

    def _scratch(self, n: int, like: torch.Tensor) -> torch.Tensor:
        if self.local is None or self.local.numel() < n or self.local.dtype != like.dtype:
            self.local = torch.empty(n, dtype=like.dtype, device=like.device)
            self.recv = (torch.empty(self.world * n, dtype=like.dtype, device=like.device)
                         if self.rank == 0 else None)
        return self.local[:n]

    def gather(self, params: list[torch.nn.Parameter], buffer: torch.Tensor | None,
               bucket) -> None:
        """Every trainer rank calls this for the same bucket; rank 0's `buffer` gets it."""
        import torch.distributed as dist

        n = sum(p.ds_tensor.numel() for p in params)
        local = self._scratch(n, params[0].ds_tensor)
        torch.cat([p.ds_tensor.view(-1) for p in params], out=local)
        if self.rank != 0:
            dist.gather(local, None, dst=0)
            return
        shards = [self.recv[r * n:(r + 1) * n] for r in range(self.world)]
        dist.gather(local, shards, dst=0)
        offset = 0
        for p, meta in zip(params, bucket.tensors, strict=True):
            size = p.ds_tensor.numel()
            full = buffer[meta.offset:meta.offset + meta.nbytes].view(p.dtype)
            for r, shard in enumerate(shards):
                start, count = shard_range(r, size, p.ds_numel)
                full[start:start + count].copy_(shard[offset:offset + count])
            offset += size
