"""Physical floors that benchmarks/sync_speed.py sets a sync against, measured inside the
workers through `Role.call` (the production actors carry no benchmark methods). Each takes the
worker first. sync_speed ships this module to the actors by value (cloudpickle): the workers
need not import benchmarks/.
"""
from __future__ import annotations


def measure_memcpy(worker, nbytes: int, repeats: int = 3) -> float:
    """Best seconds to copy nbytes between two warm buffers on this worker's cores/device:
    the floor under an in-process (colocated) sync of that many bytes."""
    import time

    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=worker.device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        if worker.device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_broadcast(worker, nbytes: int, chunk_bytes: int, repeats: int = 3) -> float:
    """Best seconds to broadcast nbytes in chunk_bytes pieces from sync-group rank 0 into warm
    buffers, all pieces in flight at once: the link's floor under a disaggregated sync. Every
    member of the sync group calls this together."""
    import time

    import torch

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=worker.device)  # touched: warm
    group = worker.sync_group
    group.broadcast(buf[:1]).wait()  # connections up before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        works = [group.broadcast(buf[o:o + chunk_bytes]) for o in range(0, nbytes, chunk_bytes)]
        for w in works:
            w.wait()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_gather(worker, bucket_bytes: int, repeats: int = 3) -> float:
    """Best seconds to gather every parameter from ZeRO-3, bucket by bucket, with no
    consumer: the trainer's own floor under any sync (every rank calls this together)."""
    import time

    from weight_sync.buckets import iter_full_weights

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in iter_full_weights(worker.trainer_role.trainer.module, bucket_bytes, {}):
            pass
        best = min(best, time.perf_counter() - t0)
    return best


def measure_reload(worker, model_path: str, repeats: int = 3) -> float:
    """Best seconds for the engine to load a checkpoint's tensors already in memory: the
    engine's own floor under any sync. Leaves the engine stale (it holds that checkpoint)."""
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    weights = [item for f in sorted(Path(model_path).glob("*.safetensors"))
               for item in load_file(f).items()]
    worker.rollout_role.policy_version = None
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.rollout_role.engine.load_weights(weights)
        best = min(best, time.perf_counter() - t0)
    return best
