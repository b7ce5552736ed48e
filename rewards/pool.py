"""Reward calls in worker processes: in parallel, off the controller's thread, each with a
timeout. A call that hangs past its timeout has its worker killed and replaced; a call that
raises (or kills its worker) is reported as an error. Nothing a reward does stops the run.

Calls go to a worker in chunks (one pipe round trip per call cost 12 ms for 256 exact-answer
calls, the whole reward phase), and the worker answers each as it finishes: the timeout still
runs per call, from the previous answer. The calls a killed worker had not reached yet go to
the next free worker. A worker's start-up (the interpreter, the reward's imports) is not a
call's time: a call's timeout runs from when its worker said it was ready, and a worker gets
STARTUP_TIMEOUT_S to say so.
"""
from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
READY = "ready"  # a worker's first message: its rewards are imported
# A worker still starting after this long is taken as hung (its first call times out). Not the
# calls' timeout: under load a replacement's spawn and imports took longer than a 1 s
# reward.timeout_s, and the fast call it was given came back a timeout.
STARTUP_TIMEOUT_S = 120.0


def _call(fn, kwargs):
    out = fn(**kwargs)
    if inspect.isawaitable(out):  # async def rewards
        async def _await():
            return await out
        out = asyncio.run(_await())
    return out


def _worker_main(conn, specs: list[str]) -> None:
    from rewards.registry import resolve

    fns = [resolve(s) for s in specs]
    conn.send((None, READY, None))
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        for call_id, term, kwargs in chunk:  # one answer per call, as each finishes
            try:
                conn.send((call_id, OK, _call(fns[term], kwargs)))
            except BaseException:  # report everything; the worker lives on
                try:
                    conn.send((call_id, ERROR, traceback.format_exc()))
                except Exception:  # the traceback itself did not pickle
                    conn.send((call_id, ERROR,
                               "reward raised an exception that could not be sent"))


@dataclass
class _Worker:
    process: mp.Process
    conn: object
    assigned: deque = field(default_factory=deque)  # call ids sent and not answered, in order
    deadline: float = 0.0  # of the first assigned call
    ready: bool = False  # it said READY: the calls' deadlines run


class RewardPool:
    def __init__(self, specs: list[str], num_workers: int, timeout_s: float):
        self.specs, self.timeout_s = specs, timeout_s
        self._ctx = mp.get_context("spawn")  # no fork of a process holding threads / Ray
        self.workers = [self._spawn() for _ in range(max(1, num_workers))]

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main, args=(child, self.specs), daemon=True)
        p.start()
        child.close()
        return _Worker(p, parent)

    def _start_clock(self, w: _Worker) -> None:
        """w's first assigned call's deadline: its timeout from now once w is ready, else the
        start-up's bound (the timeout starts at READY)."""
        w.deadline = time.monotonic() + (self.timeout_s if w.ready else STARTUP_TIMEOUT_S)

    def _replace(self, w: _Worker) -> None:
        w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()
        self.workers[next(i for i, x in enumerate(self.workers) if x is w)] = self._spawn()

    def run(self, calls: list[tuple[int, dict]]) -> list[tuple[str, object]]:
        """calls: (term index, kwargs); returns (status, value or traceback) per call, in order."""
        results: list = [None] * len(calls)
        pending = deque(range(len(calls)))
        size = max(1, len(calls) // (4 * len(self.workers)))  # a few chunks per worker
        while pending or any(w.assigned for w in self.workers):
            for w in self.workers:
                if not w.assigned and pending:
                    ids = [pending.popleft() for _ in range(min(size, len(pending)))]
                    w.assigned.extend(ids)
                    self._start_clock(w)
                    w.conn.send([(cid, calls[cid][0], calls[cid][1]) for cid in ids])
            busy = [w for w in self.workers if w.assigned]
            wait_for = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=wait_for)
            for w in busy:
                if w.conn in ready:
                    try:
                        cid, status, value = w.conn.recv()
                    except (EOFError, OSError):  # the reward killed its own worker
                        w.process.join(timeout=5)  # for its exit code
                        results[w.assigned.popleft()] = (
                            ERROR, f"the reward's worker process died (exit code "
                                   f"{w.process.exitcode})")
                        self._requeue(w, pending)
                        continue
                    if status == READY:
                        w.ready = True
                        self._start_clock(w)
                        continue
                    w.assigned.popleft()  # cid: the worker answers in order
                    results[cid] = (status, value)
                    self._start_clock(w)
                elif time.monotonic() >= w.deadline and not w.conn.poll():
                    # poll: an answer that came while an earlier worker of this pass was being
                    # replaced (kill, join, spawn) is past `ready`, not late
                    results[w.assigned.popleft()] = (TIMEOUT, None)
                    self._requeue(w, pending)
        return results

    def _requeue(self, w: _Worker, pending: deque) -> None:
        """Replace a dead or killed worker; the calls it had not reached go first in line."""
        pending.extendleft(reversed(w.assigned))
        w.assigned.clear()
        self._replace(w)

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
        self.workers = []
