"""What both worker roles share: the process set-up (threads, core pinning, the device), random
states, the timeline's spans, the weight-sync group's rendezvous.

The actors are a trainer rank (rl.run.trainer_worker), a rollout engine (rl.run.rollout_worker),
or both taking turns in one process (rl.run.colocated_worker). They only wire things together:
the trainer, the engine and the weight transport stay separate objects.
"""
from __future__ import annotations

import os

from rl.observe.timeline import Spans


def cpu_binding(rank: int, world_size: int, num_cpus: int, first_core: int = 0) -> str:
    """The cores rank `rank` owns among num_cpus cores from first_core, as 'a-b' for
    VLLM_CPU_OMP_THREADS_BIND."""
    per_rank = max(1, num_cpus // world_size)
    first = first_core + (rank * per_rank) % num_cpus
    return f"{first}-{first + per_rank - 1}"


def release_free_memory() -> None:
    """Hand memory the process freed back to the system: tcmalloc (ray.cpu_malloc) and glibc
    both keep freed pages for reuse, so a kept actor would go on holding a freed KV cache."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "MallocExtension_ReleaseFreeMemory"):  # tcmalloc
        libc.MallocExtension_ReleaseFreeMemory()
    elif hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


class Role:
    """Process set-up shared by both roles: threads and core pinning on CPU, the device name."""

    cpu_cores: tuple[int, int] | None = None  # on CPU: (first, count) of the cores of the ranks

    def __init__(self, rank: int, world_size: int, cores: tuple[int, int] | None = None):
        """cores: (first, count) of the machine's cores this role's ranks share (a
        disaggregated run whose roles work at the same time); None: all of them."""
        import torch

        self.rank, self.world_size = rank, world_size
        if not torch.cuda.is_available():
            first_core, num_cpus = cores or (0, os.cpu_count() or 1)
            self.cpu_cores = (first_core, num_cpus)  # the cores this role's ranks share
            threads = max(1, num_cpus // world_size)
            # vLLM makes torch.set_num_threads a no-op once it binds threads: set them first.
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            cores = cpu_binding(rank, world_size, num_cpus, first_core)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
            # Pin now, not only once vLLM binds its threads: unpinned ranks that spin in
            # DeepSpeed's shared-memory collectives made warm-up steps up to 4x slower.
            first, last = map(int, cores.split("-"))
            os.sched_setaffinity(0, range(first, last + 1))
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        from update.distributed import device_name

        self.device = device_name()
        self.sync_group = None
        self.spans = Spans()  # for the run's timeline.json

    def rng_state(self) -> dict:
        """This process's random states, for a checkpoint (rl.run.checkpoint saves them)."""
        from rl.run.checkpoint import rng_state

        return rng_state()

    def set_rng_state(self, state: dict) -> None:
        from rl.run.checkpoint import set_rng_state

        set_rng_state(state)

    def free_models(self) -> None:
        """Drop this role's models (the placement is kept for a later run, rl.run.placement's
        PlacementPool); the next init_trainer / init_rollout builds new ones."""
        import gc

        self.spans = Spans()  # recording, as in a new actor
        gc.collect()
        release_free_memory()

    def drain_spans(self, keep_recording: bool = True) -> list:
        """The spans recorded since the last call; stop recording when told to."""
        self.spans.enabled = keep_recording
        return self.spans.drain()

    def hostname(self) -> str:
        import socket

        return socket.gethostname()

    def free_address(self) -> tuple[str, int]:
        """(this node's IP, a free port), for a process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float) -> None:
        """Join the weight-sync group (trainer rank 0 is its rank 0, engines follow)."""
        import ray

        from weight_sync.collective import CollectiveGroup

        # gloo binds to the address Ray reaches this node by: host names need not resolve
        self.sync_group = CollectiveGroup(host, port, rank, world_size, self.device, timeout_s,
                                          bind_address=ray.util.get_node_ip_address())

    def call(self, fn, *args, **kwargs):
        """fn(self, *args, **kwargs) in this actor: what a benchmark measures through an actor's
        state (benchmarks/probes.py) without a method of its own in the production actors."""
        return fn(self, *args, **kwargs)
