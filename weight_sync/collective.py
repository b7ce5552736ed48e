"""A process group for weight sync that lives beside, not inside, torch.distributed's world.

The trainer's ranks already own the default process group (DeepSpeed), and an in-process vLLM
engine makes its own; the sync group spans trainer rank 0 and every rollout engine, so it is
built directly from a TCPStore and a gloo (CPU) or NCCL (GPU) backend object, registered nowhere
global. Rank 0 (the trainer) hosts the store.
"""
from __future__ import annotations

from datetime import timedelta

import torch


class CollectiveGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, device: str,
                 timeout_s: float = 600.0, bind_address: str | None = None):
        """bind_address (CPU): the local address gloo listens on and connects from, e.g. the
        node's IP that Ray uses; None lets gloo resolve this host's name (which fails or picks
        loopback on hosts whose name does not resolve to a reachable address)."""
        from torch.distributed import PrefixStore, TCPStore

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = rank, world_size, device
        self._store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        store = PrefixStore("rlstack/weight_sync", self._store)
        if device == "cuda":
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = ProcessGroupNCCL(store, rank, world_size, options)
        else:
            from torch.distributed.distributed_c10d import ProcessGroupGloo

            if bind_address is None:
                self._pg = ProcessGroupGloo(store, rank, world_size, timeout)
            else:
                options = ProcessGroupGloo._Options()
                options._devices = [ProcessGroupGloo.create_device(hostname=bind_address)]
                options._timeout = timeout
                options._threads = 2
                self._pg = ProcessGroupGloo(store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start broadcasting `tensor` from rank src (in place on the others); returns a work
        handle whose wait() finishes it. Calls are matched across ranks by their order."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """A small message from src to every rank (length first, then the bytes)."""
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64,
                            device=self.device)
        self.broadcast(size, src).wait()
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf, src).wait()
        return bytes(buf.cpu().numpy()) if self.rank != src else data
