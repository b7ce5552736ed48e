"""A step timeline: what each process did when, as `timeline.json` in Chrome trace format
(open it in https://ui.perfetto.dev or chrome://tracing).

Every process (the driver and each Ray actor) keeps its own `Spans`: named intervals on the
wall clock (`time.time()`, so processes on one machine share it; on a cluster each host's clock
counts). The controller drains the actors' spans after each step and `Timeline` writes one track
per process, so a reader sees which actor waits for which.
"""
from __future__ import annotations

import functools
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

Span = tuple  # (name, start seconds, end seconds, args dict)


class Spans:
    """The spans one process recorded since the last `drain`."""

    def __init__(self) -> None:
        self.items: list[Span] = []
        self.enabled = True

    @contextmanager
    def span(self, name: str, **args):
        if not self.enabled:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            self.items.append((name, start, time.time(), args))

    def drain(self) -> list[Span]:
        items, self.items = self.items, []
        return items


def traced(name: str):
    """Record each call of a method of an object with a `spans` attribute as span `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            with self.spans.span(name):
                return fn(self, *args, **kwargs)
        return inner
    return wrap


class Timeline:
    """Chrome trace events of the first `max_steps` RL steps (and the set-up before them),
    one track per process; rewritten after each step so a run stopped early still has one."""

    def __init__(self, path: Path, max_steps: int, keep_until: int | None = None):
        """keep_until: a resumed run keeps the events of steps up to its checkpoint's."""
        self.path, self.max_steps = path, max_steps
        self.tracks: dict[str, int] = {}
        self.events: list[dict] = []
        if keep_until is not None and path.exists():
            old = json.loads(path.read_text())["traceEvents"]
            self.events = [e for e in old if e["ph"] == "M" or e["args"]["step"] <= keep_until]
            self.tracks = {e["args"]["name"]: e["pid"] for e in old
                           if e["ph"] == "M" and e["name"] == "process_name"}

    def recording(self, step: int) -> bool:
        return self.max_steps > 0 and step <= self.max_steps

    def _track(self, name: str) -> int:
        if name not in self.tracks:
            pid = max(self.tracks.values(), default=-1) + 1
            self.tracks[name] = pid
            self.events += [
                {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                 "args": {"sort_index": pid}}]
        return self.tracks[name]

    def add(self, track: str, spans: list[Span], step: int) -> None:
        pid = self._track(track)
        for name, start, end, args in spans:
            # spans that overlap within a process (env steps in threads) name a lane of their own
            self.events.append({"ph": "X", "name": name, "cat": "rl", "pid": pid,
                                "tid": args.get("lane", 0),
                                "ts": round(start * 1e6), "dur": round((end - start) * 1e6),
                                "args": {"step": step, **args}})

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms",
                                   "otherData": {"pid": os.getpid()}}))
        tmp.replace(self.path)
