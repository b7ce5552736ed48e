"""What every worker actor shares: the process set-up (threads, core pinning, the device), random
states, the timeline's spans, the weight-sync group's rendezvous.

The actors are a trainer rank (rl.run.trainer_worker), a rollout engine (rl.run.rollout_worker),
or one of each taking turns in one process (rl.run.colocated_worker). Each actor holds its
roles (`TrainerRole`, `RolloutRole`) as parts, which read the process's facts (`Process`) and
never their actor; Ray makes an actor's remote methods from its class, so `holds` gives the
actor class a method for each of its parts'.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
import functools
import gc
import inspect
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


RENDEZVOUS_PORTS = (20000, 32768)  # above Ray's worker ports (10002-19999), below the kernel's
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"  # outgoing connections' ports


def rendezvous_port(tries: int = 64, rng=None) -> int:
    """A free port for a process group's rendezvous, which its rank 0 binds seconds later (its
    imports come first). Not one the kernel hands out to outgoing connections: a port taken by
    bind(0) is from that range, and a run starting beside others' start-ups (their gRPC
    connections) lost it to one in the meantime (EADDRINUSE in init_distributed). A random port
    below that range and above Ray's workers', free now; bind(0)'s where none is found."""
    import random
    import socket

    rng = rng or random.SystemRandom()
    low, high = RENDEZVOUS_PORTS
    try:
        with open(EPHEMERAL) as f:
            high = min(high, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(tries if high > low else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextmanager
def lasting(replaces: bool = False):
    """Build, inside, what the process keeps for long (a trainer, an engine, and the modules
    their imports bring) with Python's cyclic collector paused, then freeze it out of the
    collector's passes. `replaces`: what an earlier `lasting` froze has been let go (a
    trainer replaced): thaw it first, so that it is collected.

    The collector passes over every object each time the old ones have grown by a quarter, and
    vLLM collects several times while it builds an engine. An actor's build makes ~750,000
    objects that live as long as the process, so a colocated worker's start-up spent a third
    of its CPU in those passes (3.4 of 9.2 CPU-s, measured). What is there on entry is frozen
    too, once collected; what the build left as garbage is collected once at the end. vLLM
    freezes the heap after building an engine as well, and thaws it when the engine shuts down
    (a later build collects that engine); Ray Serve's replicas freeze after their start-up."""
    settle(thaw=replaces)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        settle()


def settle(thaw: bool = False) -> None:
    """Collect the garbage and freeze what is left out of the collector's later passes. `thaw`:
    what was frozen before is collected too (its models just let go)."""
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


@dataclass
class Process:
    """A worker process's facts, shared by the roles it holds."""

    rank: int  # among the actors of its kind (trainer ranks, or engines)
    world_size: int
    device: str  # "cpu" or "cuda"
    cpu_cores: tuple[int, int] | None = None  # on CPU: (first, count) of the cores of the ranks
    spans: Spans = field(default_factory=Spans)  # for the run's timeline.json
    sync_group: object = None  # weight_sync.collective.CollectiveGroup, once joined


class OnProcess:
    """Reads its process's facts as its own attributes (`traced` records into `spans`)."""

    process: Process
    rank = property(lambda self: self.process.rank)
    world_size = property(lambda self: self.process.world_size)
    device = property(lambda self: self.process.device)
    cpu_cores = property(lambda self: self.process.cpu_cores)
    spans = property(lambda self: self.process.spans)
    sync_group = property(lambda self: self.process.sync_group)


def holds(**parts: type):
    """Class decorator for a worker actor that holds parts (attribute name -> part class, each
    made with the actor's Process): every public method of a part that the actor class does
    not have becomes the actor's, calling its part's. A name two parts both offer must be
    defined by the actor."""
    def decorate(cls):
        cls.parts = {**getattr(cls, "parts", {}), **parts}
        for attr, part_cls in parts.items():
            for name, fn in inspect.getmembers(part_cls, inspect.isfunction):
                current = getattr(cls, name, None)
                to = getattr(current, "forwards_to", None)
                if name.startswith("_") or current is not None and to is None:
                    continue  # private, or the actor's own
                if to not in (None, attr):
                    raise TypeError(f"{cls.__name__}.{name} is offered by its parts {to} and "
                                    f"{attr}: define it on {cls.__name__}")
                setattr(cls, name, _forwarder(attr, name, fn))
        return cls
    return decorate


def _forwarder(attr: str, name: str, fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return getattr(getattr(self, attr), name)(*args, **kwargs)

    method.forwards_to = attr
    return method


class Role(OnProcess):
    """A worker actor's process set-up: threads and core pinning on CPU, the device name; the
    parts it holds (`holds`)."""

    parts: dict[str, type] = {}

    def __init__(self, rank: int, world_size: int, cores: tuple[int, int] | None = None):
        """cores: (first, count) of the machine's cores this role's ranks share (a
        disaggregated run whose roles work at the same time); None: all of them."""
        with lasting():
            import torch

        cpu_cores = None
        if not torch.cuda.is_available():
            first_core, num_cpus = cores or (0, os.cpu_count() or 1)
            cpu_cores = (first_core, num_cpus)  # the cores this role's ranks share
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

        self.process = Process(rank, world_size, device_name(), cpu_cores)
        for attr, part_cls in self.parts.items():
            setattr(self, attr, part_cls(self.process))

    def rng_state(self) -> dict:
        """This process's random states, for a checkpoint (rl.run.checkpoint saves them)."""
        from rl.run.checkpoint import rng_state

        return rng_state()

    def set_rng_state(self, state: dict) -> None:
        from rl.run.checkpoint import set_rng_state

        set_rng_state(state)

    def free_models(self) -> None:
        """Drop this actor's models (the placement is kept for a later run, rl.run.placement's
        PlacementPool); the next init_trainer / init_rollout builds new ones. An actor whose
        parts hold models frees theirs first."""
        for attr in self.parts:
            getattr(self, attr).free_models()
        self.process.spans = Spans()  # recording, as in a new actor
        settle(thaw=True)  # the models were frozen by `lasting`; what is left (the modules) lasts
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
        import ray

        return ray.util.get_node_ip_address(), rendezvous_port()

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float) -> None:
        """Join the weight-sync group (trainer rank 0 is its rank 0, engines follow)."""
        import ray

        from weight_sync.collective import CollectiveGroup

        # gloo binds to the address Ray reaches this node by: host names need not resolve
        self.process.sync_group = CollectiveGroup(
            host, port, rank, world_size, self.device, timeout_s,
            bind_address=ray.util.get_node_ip_address())

    def call(self, fn, *args, **kwargs):
        """fn(self, *args, **kwargs) in this actor (its parts: `trainer_role`, `rollout_role`):
        what a benchmark measures through an actor's state (benchmarks/probes.py) without a
        method of its own in the production actors."""
        return fn(self, *args, **kwargs)
