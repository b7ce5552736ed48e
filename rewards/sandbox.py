"""Running model-written Python against test cases, isolated by the operating system.

A policy under RL finds every way to raise its reward, so the program is treated as hostile:
- Namespaces (util-linux `unshare`): its own mount, PID, network, IPC, UTS namespaces, and a
  user namespace of its own where only `nobody` exists. It sees /usr read-only, four devices,
  its own processes in /proc, and tmpfs /work and /tmp; no host file, no network, no
  environment. Pid 1 of the namespace (rewards/sandbox_init.py) builds this, then runs the
  runner (rewards/sandbox_runner.py); when pid 1 exits the kernel kills everything left.
- Resource limits: CPU, memory, file size, open files, processes, tmpfs sizes.
- Nothing outlives the call: `setpriv --pdeathsig` and `unshare --kill-child` tie the tree to
  the calling process (a reward pool kills its worker on a timeout); at our own deadline the
  process group is killed; pid 1 keeps its own deadline. Nothing is written to the host's disk.
- Verdicts are made here (rewards/cases.py): the sandbox only answers, and never sees an
  expected value, so tampering with the interpreter changes nothing but its own answers.
Where the namespaces cannot be made, check_isolation() says what is missing; run_cases(...,
isolated=False) is the opt-out: the same runner as a plain process with the same limits.
"""
from __future__ import annotations

import json
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rewards.cases import check_tests, public, read_answers, verdicts

HERE = Path(__file__).parent
INIT_SOURCE = (HERE / "sandbox_init.py").read_text()
RUNNER_SOURCE = (HERE / "sandbox_runner.py").read_text()
SYSTEM_PYTHON = "/usr/bin/python3"
ANSWERS_CAP = 4 << 20  # bytes of answers read back; a program that floods stops being read
ERRORS_CAP = 4096


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program); the message says how."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    "Wall-clock limit of one program's run over all its cases; later answers fail."
    memory_mb: int = 512
    "Address space per process (RLIMIT_AS)."
    cpu_s: float | None = None
    "CPU seconds per process (RLIMIT_CPU); None: timeout_s."
    file_mb: int = 16
    "Largest file a process may write (RLIMIT_FSIZE)."
    disk_mb: int = 64
    "Size of each of the tmpfs /work and /tmp (they live in memory)."
    open_files: int = 64
    "Open files per process (RLIMIT_NOFILE)."
    processes: int = 64
    "Processes and threads of the program together (RLIMIT_NPROC of its own user)."

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "file_mb", "disk_mb", "open_files", "processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"code_exec {name}={value!r}: must be a number > 0")
        if self.cpu_s is not None and (isinstance(self.cpu_s, bool) or not isinstance(
                self.cpu_s, (int, float)) or not self.cpu_s > 0):
            raise ValueError(f"code_exec cpu_s={self.cpu_s!r}: must be a number > 0 (or unset: "
                             f"timeout_s)")
        if self.memory_mb < 64:
            raise ValueError(f"code_exec memory_mb={self.memory_mb}: the interpreter alone "
                             f"needs more; give at least 64")

    def for_sandbox(self) -> dict:
        out = asdict(self)
        out["cpu_s"] = self.timeout_s if self.cpu_s is None else self.cpu_s
        return out


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else any fenced block, else the whole completion."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def sandbox_python() -> tuple[str, list[str]]:
    """(interpreter, directories to bind for it). The system's python3 lives under /usr, which
    the sandbox shows anyway; otherwise our base interpreter, its prefix bound read-only."""
    if os.access(SYSTEM_PYTHON, os.X_OK):
        return SYSTEM_PYTHON, []
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        raise SandboxError(f"no interpreter for the sandbox: {SYSTEM_PYTHON} is absent and "
                           f"{exe} is not under its prefix {prefix}; install python3")
    return exe, [] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix]


def _command(python: str) -> list[str]:
    tools = {name: shutil.which(name) for name in ("setpriv", "unshare")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise SandboxError(f"util-linux {' and '.join(missing)} not found on PATH")
    # Root: the namespaces directly. Others: a user namespace where the caller is root first.
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [tools["setpriv"], "--pdeathsig", "KILL", "--", tools["unshare"], "--mount", "--pid",
            "--net", "--ipc", "--uts", "--fork", "--kill-child", *user, "--",
            python, "-I", "-S", "-c", INIT_SOURCE]


def _exchange(proc: subprocess.Popen, request: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Send the request, read stdout (answers) and stderr (set-up errors) until both close,
    the deadline passes, or the answers pass their cap."""
    sel = selectors.DefaultSelector()
    pipes = [p for p in (proc.stdin, proc.stdout, proc.stderr) if p is not None]
    for pipe in pipes:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_WRITE if pipe is proc.stdin else selectors.EVENT_READ)
    out, err, sent = bytearray(), bytearray(), 0
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 or len(out) > ANSWERS_CAP:
                break
            for key, _ in sel.select(left):
                pipe = key.fileobj
                if pipe is proc.stdin:
                    try:
                        sent += os.write(pipe.fileno(), request[sent:sent + 65536])
                    except BrokenPipeError:  # pid 1 died early; its stderr says why
                        sent = len(request)
                    if sent >= len(request):
                        sel.unregister(pipe)
                        pipe.close()
                    continue
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    sel.unregister(pipe)
                elif pipe is proc.stdout:
                    out += chunk
                elif len(err) < ERRORS_CAP:
                    err += chunk
    finally:
        sel.close()
    return bytes(out[:ANSWERS_CAP]), bytes(err)


def _finish(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (pid 1 with it, so the namespace), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone, group and all
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def start_isolated(code: str, job: dict, limits: Limits) -> tuple[subprocess.Popen, bytes]:
    """The sandbox's process (setpriv, then unshare, then pid 1) and the request to send it."""
    python, binds = sandbox_python()
    request = json.dumps({"python": python, "binds": binds, "nested": os.geteuid() != 0,
                          "runner": RUNNER_SOURCE, "code": code, "job": job,
                          "limits": limits.for_sandbox()}).encode() + b"\n"
    proc = subprocess.Popen(_command(python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={}, cwd="/", start_new_session=True)
    return proc, request


def run_isolated(code: str, job: dict, limits: Limits) -> bytes:
    """The runner's answers from a sandboxed run; SandboxError when the sandbox failed."""
    deadline = time.monotonic() + limits.timeout_s
    proc, request = start_isolated(code, job, limits)
    try:
        out, err = _exchange(proc, request, deadline)
    finally:
        _finish(proc)
    if err.strip():  # only setpriv, unshare and pid 1 can write there: the program cannot
        line = err.decode(errors="replace").strip().splitlines()[-1]
        raise SandboxError(f"the sandbox did not start: {line}")
    return out


def run_unisolated(code: str, job: dict, limits: Limits) -> bytes:
    """The opt-out: the same runner in a plain process with the limits, in a temporary
    directory; the program can read and write the caller's files and use the network."""
    python, _ = sandbox_python()
    values = limits.for_sandbox()

    def apply_limits():
        mib = 1 << 20
        for which, value in ((resource.RLIMIT_CPU, max(1, int(values["cpu_s"] + 0.999))),
                             (resource.RLIMIT_AS, values["memory_mb"] * mib),
                             (resource.RLIMIT_FSIZE, values["file_mb"] * mib),
                             (resource.RLIMIT_NOFILE, values["open_files"]),
                             (resource.RLIMIT_NPROC, values["processes"]),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))

    with tempfile.TemporaryDirectory(prefix="rl-code-exec-") as workdir:
        Path(workdir, "solution.py").write_text(code, encoding="utf-8")
        Path(workdir, "cases.json").write_text(json.dumps(job), encoding="utf-8")
        deadline = time.monotonic() + limits.timeout_s
        proc = subprocess.Popen([python, "-I", "-S", "-c", RUNNER_SOURCE], cwd=workdir,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env={}, start_new_session=True,
                                preexec_fn=apply_limits)
        try:
            out, _ = _exchange(proc, b"", deadline)
        finally:
            _finish(proc)
    return out


def run_cases(code: str, cases: list[dict], limits: Limits = Limits(),
              isolated: bool = True) -> list[bool]:
    """Pass/fail per case of `code` (see rewards/cases.py for the forms), decided here."""
    check_tests(cases, "this row")
    job = {"timeout_s": limits.timeout_s, "cases": [public(c) for c in cases]}
    raw = (run_isolated if isolated else run_unisolated)(code, job, limits)
    return verdicts(cases, read_answers(raw, cases))


PROBE = """
import os, socket
def probe():
    env = sorted(k for k in os.environ if k != "LC_CTYPE")  # python sets LC_CTYPE itself
    return [os.getuid(), socket.gethostname(), env, os.getppid(), os.path.exists("/etc")]
"""
# nobody, its own host name, no environment, a parent that is pid 1 of a new PID namespace,
# none of the host's files
PROBE_EXPECT = [65534, "sandbox", [], 1, False]
_isolation_ok = False  # once a probe passed in this process; a failure is probed again next time


def isolation_problem() -> str | None:
    """None when a probe program ran isolated here, else what went wrong. Only success is
    remembered: a probe that failed on a busy machine must not disable code_exec for good."""
    global _isolation_ok
    if _isolation_ok:
        return None
    case = {"fn": "probe", "args": [], "expect": PROBE_EXPECT}
    try:
        raw = run_isolated(PROBE, {"timeout_s": 10.0, "cases": [public(case)]},
                           Limits(timeout_s=10.0))
    except (SandboxError, OSError) as e:
        return str(e)
    answers = read_answers(raw, [case])
    if not verdicts([case], answers)[0]:
        return f"a probe program saw {answers.get(0)} where {PROBE_EXPECT} was due"
    _isolation_ok = True
    return None


def check_isolation() -> None:
    """Raise SandboxError, one line, when programs cannot be isolated on this machine."""
    problem = isolation_problem()
    if problem:
        raise SandboxError(
            f"code_exec cannot isolate programs on this machine: {problem}. It needs util-linux "
            f"unshare and setpriv and, unless run as root, unprivileged user namespaces. Only "
            f"if the model is trusted, set args: {{unsafe_no_isolation: true}} on the code_exec "
            f"reward term to run programs without isolation")
