"""Shared by the code_exec sandbox tests: scoring a program in either form of the sandbox, the
pieces of the test programs, host-side traps the program must not reach."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import rewards

ROOT = Path(rewards.__file__).resolve().parents[1]  # this checkout, for tests in a subprocess
SOLVE = "def solve(x):\n    return x\n"
CASES = [{"fn": "solve", "args": [1], "expect": 1}]  # what score() runs unless told otherwise


def hostile(attack: str) -> str:
    """`attack` at import time, then a correct solve: it loads only if the attack succeeded."""
    return textwrap.dedent(attack) + "\n" + SOLVE


@pytest.fixture
def programs():
    """The pieces of the test programs: solve (correct for cases), cases, hostile(attack)."""
    return SimpleNamespace(solve=SOLVE, cases=CASES, hostile=hostile)


@pytest.fixture(params=["root", "user"])
def form(request, monkeypatch, namespaces):
    """Each test that scores runs in both forms of the sandbox: 'root' (root with
    CAP_SYS_ADMIN makes the namespaces directly) and 'user' (in a user namespace first, as
    for any other caller; there the program runs as the caller's own host user)."""
    import rewards.sandbox as sandbox

    natural = "user" if sandbox.needs_user_namespace() else "root"
    if request.param == "root" and natural == "user":
        pytest.skip("the root form needs root with CAP_SYS_ADMIN")
    monkeypatch.setattr(sandbox, "needs_user_namespace", lambda: request.param == "user")
    return request.param


@pytest.fixture
def score(form):
    """score(code, cases=CASES, **limits): the reward code_exec's sandbox gives `code`."""
    from rewards.sandbox import Limits, run_cases

    def run(code, cases=CASES, **limits):
        limits.setdefault("timeout_s", 10.0)  # roomy: a loaded machine must not fail a test
        passed = run_cases(code, cases, Limits(**limits))
        return sum(passed) / len(cases)

    return run


def _run_python(script: str, *, before=(), python=sys.executable, user=None) -> object:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(script)
    done = subprocess.run([*before, python, "-I", "-c", code], capture_output=True, text=True,
                          cwd="/", timeout=120, user=user)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def run_python():
    """run_python(script, before=(), python=, user=): `script` in a fresh interpreter (after
    the command `before`, e.g. setpriv ...), with this checkout's rewards/ importable; what it
    printed last, as JSON. For what a test cannot do in pytest's own process."""
    return _run_python


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
