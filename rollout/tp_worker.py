"""What a tensor-parallel engine's rank processes do for the rest of rlstack.

At rollout.tensor_parallel_size > 1 vLLM runs each TP rank in a worker process of its own (its
multiprocess executor; on CPU, with VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine core stays in
the calling process). The weights live in those workers, so nothing in the engine's process can
copy into them. `TPWorker` is mixed into vLLM's worker class (`worker_extension_cls`); its
methods run on every rank through `LLM.collective_rpc`:
- `rl_parameters`: each rank's parameters (vLLM names, its local TP shapes, dtype, and which
  names share storage: a tied head);
- `rl_share_weights`: the rank copies its parameters into a file in shared memory at the byte
  offsets it is given and points them at it. Any process of the host that maps the file then
  writes the rank's weights in place: a weight sync (weight_sync.tp_shared) needs no RPC with
  tensors and no second copy;
- `rl_weights_changed`: after such writes, re-pack the linears that compute from packed copies.

The module is imported by each worker before its model loads, so the CPU linear dispatch
(rollout.cpu_linear, see `install_cpu_linear_dispatch`) is installed there too, in the mode the
engine passes through the environment (RL_CPU_LINEAR).

It also shortens how long a rank keeps spinning for the engine's next call once calls stop
(vLLM's shared-memory queue: 1 s of sched_yield, then a sleeping poll). On CPU the ranks share
their cores with the trainer ranks (colocated) or with the weight sync's copies (their engine's
actor), which come right after generation ends: a second of spinning on each core slowed them.
Between the steps of a generation the calls come every few milliseconds and the ranks still
spin.
"""
from __future__ import annotations

import mmap
import os

import torch

from rollout.vllm_cpu import CPU_LINEAR_ENV, patch_cpu_engine, repack_linears

IDLE_SPIN_S = 0.05  # a rank spins this long after the engine's last call, then sleeps


def spin_briefly_when_idle() -> None:
    """Make the message queues this process reads from spin IDLE_SPIN_S after the last call
    (vLLM's default: 1 s); for queues created after this call (a worker's, at its start)."""
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "rl_idle_spin", None) == IDLE_SPIN_S:
        return
    init = condition.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s=IDLE_SPIN_S):
        init(self, is_reader, context, notify_address, min(busy_loop_s, IDLE_SPIN_S))

    condition.__init__ = __init__
    condition.rl_idle_spin = IDLE_SPIN_S


if os.environ.get(CPU_LINEAR_ENV):  # a CPU engine's rank process
    patch_cpu_engine(os.environ[CPU_LINEAR_ENV])
    spin_briefly_when_idle()


class TPWorker:
    """Methods of every rank of a TP engine (called as `collective_rpc("rl_...")`)."""

    def _rl_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def rl_parameters(self) -> dict:
        """{"rank": TP rank, "params": [(name, shape, dtype, storage key), ...]}, in the order
        of named_parameters with duplicates (a tied head shares its key with the embedding)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        params = [(n, list(p.shape), str(p.dtype).removeprefix("torch."), p.data_ptr())
                  for n, p in self._rl_model().named_parameters(remove_duplicate=False)]
        return {"rank": get_tensor_model_parallel_rank(), "params": params}

    def rl_share_weights(self, paths: list[str], places: list[dict]) -> str:
        """Copy this rank's parameters into shared memory and point them there. `paths[r]` is
        rank r's file (created here, `nbytes` long) and `places[r]` {name: byte offset} for every
        name of rank r (a tied head at its embedding's offset). Returns the path."""
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        path, place = paths[rank], places[rank]
        nbytes = place.pop("__nbytes__")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # every page there now: no SIGBUS on first touch
            self._rl_map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        memory = torch.frombuffer(self._rl_map, dtype=torch.uint8)
        with torch.no_grad():
            for name, p in self._rl_model().named_parameters(remove_duplicate=False):
                offset = place[name]
                view = memory[offset:offset + p.numel() * p.element_size()]
                view = view.view(p.dtype).view(p.shape)
                if view.data_ptr() != p.data_ptr():
                    view.copy_(p.data)
                    p.data = view
        return path

    def rl_weights_changed(self) -> None:
        repack_linears(self._rl_model())
