"""Running model-written Python against tests, contained.

Each run is a fresh `python -I` process in a throw-away directory with: CPU-time, address-space,
file-size, open-file and process-count limits; no network (a new network namespace when run as
root, and socket calls refused); an unprivileged user when run as root; an audit hook that
refuses reading files outside the interpreter's own install and the run directory, writing
anywhere but that directory, starting processes, and loading native code through ctypes; and a
wall-clock timeout that kills the whole process group. It contains buggy or hostile code; it is
not a defence against a policy that learns to game the test harness itself.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

CLONE_NEWNET = 0x40000000
NOBODY = 65534

HARNESS = r'''
import json, os, sys
nonce = sys.stdin.readline().strip()
sys.stdin.close()
here = os.getcwd()
readable = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                 sys.base_exec_prefix)} | {here})
BLOCKED = ("socket.", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
           "os.system", "subprocess.", "pty.", "ctypes.", "os.kill", "os.putenv", "os.chdir",
           "os.chroot", "os.link", "os.symlink")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
solution = open("solution.py").read()
tests = json.load(open("tests.json"))
def guard(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        path = os.path.realpath(os.path.join(here, os.fsdecode(args[0])))
        mode, flags = args[1] or "", args[2] if len(args) > 2 and args[2] else 0
        writing = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
        inside = path == here or path.startswith(here + os.sep)
        if writing and not inside or not writing and not (inside or path.startswith(readable)):
            raise PermissionError(f"sandbox: open {path!r} is not allowed")
sys.addaudithook(guard)
ns = {"__name__": "__main__"}
try:
    exec(compile(solution, "solution.py", "exec"), ns)
    loaded = True
except BaseException:
    loaded = False
results = []
for test in tests:
    try:
        if not loaded:
            raise RuntimeError("the solution did not load")
        exec(compile(test, "test", "exec"), ns)
        results.append(True)
    except BaseException:
        results.append(False)
sys.stdout.write("\n" + nonce + json.dumps(results) + "\n")
sys.stdout.flush()
'''


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else any fenced block, else the whole completion."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def _world_runnable(path: str) -> bool:
    """Can an unprivileged user execute `path` (every directory on the way searchable)?"""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & 0o001:
        return False
    parent = os.path.dirname(real)
    while parent != os.path.dirname(parent):
        if not os.stat(parent).st_mode & 0o001:
            return False
        parent = os.path.dirname(parent)
    return True


def interpreter(as_root: bool) -> tuple[str, bool]:
    """(python to run, whether to drop to an unprivileged user): ours if that user can run it,
    else the system's python3; as a last resort ours, without dropping privileges."""
    if not as_root:
        return sys.executable, False
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_runnable(candidate):
            return candidate, True
    return sys.executable, False


def _limits(timeout_s: float, memory_mb: int, as_root: bool, drop_user: bool):
    def apply():
        if as_root:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNET) != 0:  # no network at all: only a down loopback
                os._exit(97)
        cpu = max(1, int(timeout_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if drop_user:  # NPROC counts processes per user: drop to an unprivileged one
            resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    return apply


def run_tests(code: str, tests: list[str], timeout_s: float = 5.0, memory_mb: int = 512) -> int:
    """How many of `tests` pass against `code`, run contained (0 when the run is killed)."""
    as_root = os.geteuid() == 0
    python, drop_user = interpreter(as_root)
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    try:
        with open(os.path.join(workdir, "solution.py"), "w") as f:
            f.write(code)
        with open(os.path.join(workdir, "tests.json"), "w") as f:
            json.dump(tests, f)
        if drop_user:
            for name in ("", "solution.py", "tests.json"):
                os.chown(os.path.join(workdir, name), NOBODY, NOBODY)
        nonce = secrets.token_hex(16)
        proc = subprocess.Popen(
            [python, "-I", "-c", HARNESS], cwd=workdir, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"},
            preexec_fn=_limits(timeout_s, memory_mb, as_root, drop_user))
        try:
            out, _ = proc.communicate(nonce.encode() + b"\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # also any children it left behind
            except ProcessLookupError:
                pass
            proc.wait()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith(nonce):
                return sum(1 for r in json.loads(line[len(nonce):]) if r is True)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
