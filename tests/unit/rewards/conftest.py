"""Shared by the code_exec sandbox tests: scoring a program, host-side traps it must not reach."""
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

CASES = [{"fn": "solve", "args": [1], "expect": 1}]  # what score() runs unless told otherwise


@pytest.fixture
def score(namespaces):
    """score(code, cases=CASES, **limits): the reward code_exec's sandbox gives `code`."""
    from rewards.sandbox import Limits, run_cases

    def run(code, cases=CASES, **limits):
        limits.setdefault("timeout_s", 10.0)  # roomy: a loaded machine must not fail a test
        passed = run_cases(code, cases, Limits(**limits))
        return sum(passed) / len(cases)

    return run


@pytest.fixture
def host_dir():
    """A world-writable directory on the host, outside /tmp (which the sandbox replaces), where
    any user could write: only the sandbox's own file system keeps a program out of it."""
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    path = Path(tempfile.mkdtemp(prefix="rlstack-sandbox-test-", dir=parent))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def listener():
    """A TCP server on the host's 127.0.0.1: (port, list of connections it accepted)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.1)
    hits, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:  # the 0.1 s accept timeout: look at `stop` again
                continue
            hits.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], hits
    stop.set()
    thread.join()
    srv.close()


def host_pids_with(markers) -> list[int]:
    """Host processes whose command line holds any of `markers`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # exited while we looked
            continue
        if any(m.encode() in cmdline for m in markers):
            found.append(int(pid))
    return found


@pytest.fixture
def leftovers():
    """leftovers(markers, wait_s): host processes still holding a marker after wait_s (a killed
    namespace takes a moment to go); pids_with(markers) looks once."""
    def wait(markers, wait_s=3.0):
        end = time.monotonic() + wait_s
        while (found := host_pids_with(markers)) and time.monotonic() < end:
            time.sleep(0.05)
        return found

    wait.pids_with = host_pids_with
    return wait
