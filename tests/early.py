"""Process-boundary runs the suite starts before its first test.

A test whose point is a CLI run in processes of its own (`rl-train` with its own cache, the
vs_trl smoke) spends most of its wall time in start-ups and waits. The unit tests run first
(tests/conftest.py) and use about one core of two, so such a run is started with the session,
in the background, and its test collects the finished process: the same command, the same
checks, only earlier. A test module registers its run at import time with `early`; the session
starts every registered run of which at least one test was selected (so `-m "not slow"` starts
none), and a test that asks for a run nobody started (the module run alone) starts it then. A
run registered `after` another starts when that one has ended (its command is made then, so it
can read what the first left).
Its stdout and stderr go to files (a pipe nobody reads would fill and stop the run); what is
still running at the session's end is stopped with its process group (SIGTERM, then
SIGKILL).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).parents[1]


class Lane:
    """The integration lane's runs start one at a time, in order: beside the in-process tests,
    two at once oversubscribed the cores. Once a test waits for a run that has not ended, the
    in-process tests are behind it (tests/conftest.py puts the lane's tests last), and two run
    at once."""

    def __init__(self):
        self.cond = threading.Condition()
        self.slots, self.running = 1, 0

    def enter(self, run: EarlyRun) -> bool:
        """Waits until the run before it has started and a slot is free; False if stopped."""
        before = run.queued_behind
        with self.cond:
            self.cond.wait_for(lambda: run.stopped or (
                self.running < self.slots and (before is None or before.launched.is_set())))
            if run.stopped:
                return False
            self.running += 1
            return True

    def leave(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def widen(self) -> None:
        with self.cond:
            self.slots = 2
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


LANE = Lane()


class EarlyRun:
    """One command, started at most once per session, in a directory of its own."""

    def __init__(self, name: str, module: Path, command: Callable[[Path], list[str]],
                 env: Callable[[Path], dict] | None, after: EarlyRun | None,
                 with_integration: bool):
        self.name, self.module, self.command, self.env = name, module, command, env
        self.after, self.with_integration = after, with_integration
        self.queued_behind: EarlyRun | None = None  # the run before it in the integration lane
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.launcher: threading.Thread | None = None
        self.launched = threading.Event()  # its process started (or it never will)
        self.stopped = False

    def start(self) -> None:
        if self.launcher is not None:
            return
        self.dir = Path(tempfile.mkdtemp(prefix=f"rl-early-{self.name}-"))
        if self.after is not None:
            self.after.start()
        self.launcher = threading.Thread(target=self._launch, daemon=True)
        self.launcher.start()

    def _launch(self) -> None:
        try:
            if self.after is not None and self.after.launcher is not None:
                self.after.launcher.join()
                if self.after.proc is not None:
                    self.after.proc.wait()
            lane = self.with_integration and LANE.enter(self)
            if self.stopped:
                if lane:  # stopped after taking its slot: give it back
                    LANE.leave()
                return
            env = self.env(self.dir) if self.env else dict(os.environ)
            with open(self.dir / "stdout", "w") as out, open(self.dir / "stderr", "w") as err:
                self.proc = subprocess.Popen(self.command(self.dir), cwd=ROOT, env=env,
                                             stdout=out, stderr=err, start_new_session=True)
        finally:
            self.launched.set()
            LANE.wake()
        if lane:
            threading.Thread(target=self._leave_when_done, daemon=True).start()

    def _leave_when_done(self) -> None:
        self.proc.wait()
        LANE.leave()

    def result(self, timeout: float = 1800) -> subprocess.CompletedProcess:
        """Waits for the run (starting it if need be); its directory is `self.dir`. The
        timeout only ever stops a hung run: a run here takes 1-3 min, a CI machine ran 4-8x
        slower, and the lane may start a run only when its test asks."""
        self.start()
        if self.proc is None or self.proc.poll() is None:
            LANE.widen()  # this test waits: the lane may use the core it leaves
        self.launcher.join()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(self.proc.args, code, (self.dir / "stdout").read_text(),
                                           (self.dir / "stderr").read_text())

    def passed(self, timeout: float = 1800) -> subprocess.CompletedProcess:
        """`result`, asserting the run exited 0 (the tails of its output if not)."""
        out = self.result(timeout)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return out

    def stop(self) -> None:
        self.stopped = True
        LANE.wake()
        if self.launcher is not None:
            self.launcher.join()
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM first: a run may have made what only it can remove (the cluster test's
            # network namespaces); what is left after 15 s is killed
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass

    def remove(self) -> None:
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


RUNS: dict[str, EarlyRun] = {}


def early(name: str, module: str, command: Callable[[Path], list[str]],
          env: Callable[[Path], dict] | None = None, after: EarlyRun | None = None,
          with_integration: bool = False) -> EarlyRun:
    """Register `command(dir)` (run in the repository root; `env(dir)` its environment, default
    this process's when it starts) as an early run of the test module at path `module` (its
    __file__); with `after`, it starts once that run has ended; `with_integration`, with the
    first integration test."""
    return RUNS.setdefault(name, EarlyRun(name, Path(module).resolve(), command, env, after,
                                          with_integration))


SELECTED: set[Path] = set()  # the modules of the session's selected tests (conftest)


def start_selected(with_integration: bool = False) -> list[EarlyRun]:
    """Start every registered run (of the phase `with_integration` says) whose module holds a
    selected test (SELECTED)."""
    started = [run for run in RUNS.values()
               if run.module in SELECTED and run.with_integration == with_integration]
    if with_integration:  # in the order of their tests, through the LANE
        started.sort(key=lambda run: run.module)
        for before, run in zip(started, started[1:]):
            run.queued_behind = before
    for run in started:
        run.start()
    return started


def lane_modules() -> list[Path]:
    """The modules of the runs started `with_integration`, in the order the lane runs them."""
    return sorted({run.module for run in RUNS.values() if run.with_integration})


def remove_all() -> None:
    for run in RUNS.values():  # none launches any more; then each is killed in the order they
        run.stopped = True     # were registered, a run before the run that waits for it
    for run in RUNS.values():
        run.remove()
