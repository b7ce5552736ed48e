"""Run a function in a world of spawned processes (gloo / DeepSpeed tests), each told its rank
and a free rendezvous port; they report through a shared dict.

`spawn_world` starts the processes for one call. `World` keeps them for many calls (a module's
tests): each call still gets a new port, so the function sets up and tears down its own
process group as with `spawn_world`; only the processes and their imports are shared."""
import traceback

import torch.multiprocessing as mp

from rl.run.role import rendezvous_port


def spawn_world(target, world_size: int, *args, timeout_s: float = 300) -> dict:
    """target(rank, world_size, port, *args, out) in world_size processes; returns out."""
    port = rendezvous_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=target, args=(r, world_size, port, *args, out))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return dict(out)


def _serve(rank: int, world_size: int, jobs, results) -> None:
    """A kept process: run each (target, port, args) it is sent, answer with (out, error)."""
    while (job := jobs.get()) is not None:
        target, port, args = job
        out: dict = {}
        try:
            target(rank, world_size, port, *args, out)
            results.put((out, None))
        except BaseException:  # reported to the test, which fails with it
            results.put((out, traceback.format_exc()))


class World:
    """world_size processes kept for many `run` calls; use as a context manager."""

    def __init__(self, world_size: int, timeout_s: float = 300):
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, self.jobs[r],
                                                       self.results[r]), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, target, *args) -> dict:
        """target(rank, world_size, port, *args, out) on every process; returns the ranks' out
        dicts merged (as `spawn_world` does), or fails with a rank's traceback."""
        port = rendezvous_port()
        for q in self.jobs:
            q.put((target, port, args))
        merged, errors = {}, []
        for rank, q in enumerate(self.results):
            out, error = q.get(timeout=self.timeout_s)
            merged.update(out)
            if error:
                errors.append(f"rank {rank}:\n{error}")
        assert not errors, "\n".join(errors)
        return merged

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        """Each process is told to stop; one still there after 5 s is killed: its jobs are
        answered and their process groups torn down, and the suite's CI run once waited 35 s
        here for a process that did not end under the start-up load."""
        import time

        for q in self.jobs:
            q.put(None)
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
