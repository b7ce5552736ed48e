"""Running model-written Python against test cases, isolated by the operating system.

A policy under RL finds every way to raise its reward, so the program is treated as hostile:
- Namespaces (util-linux `unshare`): its own mount, PID, network, IPC, UTS namespaces, and a
  user namespace of its own where only `nobody` exists. It sees /usr read-only, four devices,
  its own processes in /proc, and tmpfs /work and /tmp; no host file, no network, no
  environment, no session keyring of the caller. Pid 1 of the namespace
  (rewards/sandbox_init.py) builds this, then runs the runner (rewards/sandbox_runner.py); when
  pid 1 exits the kernel kills everything left.
- Resource limits (rewards/sandbox_limits.py): CPU, memory, file size, open files, processes,
  tmpfs sizes; memory and process totals per call where a cgroup can be made.
- The program's timeout runs from the runner's start, which it marks with its first byte on
  stdout: the sandbox's own set-up (three process starts, the mounts) gets SETUP_TIMEOUT_S of
  its own, and one that overruns it is a SandboxError, never a program that failed every case
  (under a loaded suite the set-up alone once took the whole 5 s and a right program scored 0).
- Nothing outlives the call: `setpriv --pdeathsig` and `unshare --kill-child` tie the tree to
  the calling process (a reward pool kills its worker on a timeout); at our own deadline pid 1
  is killed, then the process group; pid 1 keeps its own deadline. Nothing is written to the
  host's disk.
- Verdicts are made here (rewards/cases.py): the sandbox only answers, and never sees an
  expected value, so tampering with the interpreter changes nothing but its own answers.
Where the namespaces cannot be made, check_isolation() says what is missing and how to fix it;
run_cases(..., isolated=False) is the opt-out: the same runner as a plain process with the
same per-process limits, RLIMIT_NPROC aside.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rewards.cases import check_tests, public, read_answers, verdicts
from rewards.sandbox_init import rlimit_problem, set_limits
from rewards.sandbox_limits import CallCgroup, Limits, cgroup_bases

HERE = Path(__file__).parent
INIT_SOURCE = (HERE / "sandbox_init.py").read_text()
RUNNER_SOURCE = (HERE / "sandbox_runner.py").read_text()
SYSTEM_PYTHON = "/usr/bin/python3"
ANSWERS_CAP = 4 << 20  # bytes of answers read back; a program that floods stops being read
ERRORS_CAP = 4096
SETUP_PREFIXES = ("sandbox-init:", "unshare:", "setpriv:")  # only these speak on stderr
CAP_SYS_ADMIN = 21
# Set-up (setpriv, unshare, pid 1's interpreter and mounts, the runner's interpreter) takes
# ~0.1 s; this bounds it on a machine so loaded that interpreters start in seconds.
SETUP_TIMEOUT_S = 60.0
START_MARK = b"\n"  # the runner's first write, before it reads the program
OVERLOAD_FIX = ("give the machine fewer processes at once (reward.num_workers, other jobs); "
                "isolation itself is not at fault")
# Root in the --user form runs the program as the host's root user (inside its own user
# namespace), and the kernel never applies RLIMIT_NPROC to that user: only a cgroup bounds it.
ROOT_WITHOUT_CGROUP = ("as root without CAP_SYS_ADMIN the program runs as the host's root user "
                       "in its own namespaces, which the kernel exempts from the process limit, "
                       "and no cgroup can be made here to bound it")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program); the message says how."""


@dataclass(frozen=True)
class Interpreter:
    """The Python the programs run on."""
    path: str
    "Its real path, which the sandbox shows (under /usr or under `binds`)."
    binds: tuple[str, ...]
    "Directories bound read-only for it: its prefix when that is not under /usr."
    version: str
    "e.g. 3.11.2, printed at start so the user knows which Python judges the programs."


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def interpreter(path: str | None = None) -> Interpreter:
    """The interpreter `path` (code_exec's `python` arg), asked for its version and prefix;
    None: /usr/bin/python3, else our own base interpreter."""
    if path is None:
        default = os.access(SYSTEM_PYTHON, os.X_OK)
        path = SYSTEM_PYTHON if default else getattr(sys, "_base_executable", sys.executable)
    elif not os.path.isabs(path) or not os.access(path, os.X_OK):
        raise SandboxError(f"code_exec python={path!r} is not an executable absolute path; "
                           f"give one such as {SYSTEM_PYTHON}, or leave it unset")
    ask = "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.base_prefix)"
    try:
        out = subprocess.run([path, "-I", "-S", "-c", ask], capture_output=True, text=True,
                             env={}, timeout=60, check=True).stdout.split("\n")
        version, prefix = out[0], os.path.realpath(out[1])
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise SandboxError(f"code_exec python={path!r} does not run as a Python ({e!r}); give "
                           f"a working python3") from None
    if tuple(int(x) for x in version.split(".")[:2]) < (3, 8):
        raise SandboxError(f"code_exec python={path!r} is Python {version}; the sandbox needs "
                           f"3.8 or later")
    real = os.path.realpath(path)
    if _under(real, "/usr") and _under(prefix, "/usr"):
        return Interpreter(real, (), version)
    if not _under(real, prefix):
        raise SandboxError(f"code_exec python={path!r}: {real} is not under its prefix "
                           f"{prefix}, which the sandbox would show; give another python3")
    return Interpreter(real, (prefix,), version)


def extract_code(completion: str) -> str:
    """The body of the last fenced block that is untagged or tagged python/py (blocks in other
    languages are skipped); the whole completion when there is none."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def needs_user_namespace() -> bool:
    """The --user form unless we are root holding CAP_SYS_ADMIN (bit 21 of CapEff), which the
    namespaces need without a user namespace of their own (root in most containers lacks it),
    with nobody (65534) mapped, which the runner's user needs."""
    if os.geteuid() != 0:
        return True
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    mapped = True
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
        mapped &= any(inside <= 65534 < inside + count for inside, _, count in ranges)
    return not (caps >> CAP_SYS_ADMIN & 1 and mapped)


def _command(python: str, nested: bool) -> list[str]:
    """setpriv (the parent's death kills it), then unshare (the namespaces), then pid 1."""
    tools = {name: shutil.which(name) for name in ("setpriv", "unshare")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise SandboxError(f"util-linux {' and '.join(missing)} not found on PATH")
    user = ["--user", "--map-root-user"] if nested else []
    return [tools["setpriv"], "--pdeathsig", "KILL", "--", tools["unshare"], "--mount", "--pid",
            "--net", "--ipc", "--uts", "--fork", "--kill-child", *user, "--",
            python, "-I", "-S", "-c", INIT_SOURCE]


def _exchange(proc: subprocess.Popen, request: bytes,
              run_s: float) -> tuple[bytes, bytes, bool, bool]:
    """Send the request, read stdout (answers) and stderr (set-up errors) until both close,
    the deadline passes, or the answers pass their cap; (answers, errors, timed out, started).
    The deadline is SETUP_TIMEOUT_S until the runner's first byte (its start), then run_s from
    that byte."""
    sel = selectors.DefaultSelector()
    pipes = [p for p in (proc.stdin, proc.stdout, proc.stderr) if p is not None]
    for pipe in pipes:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_WRITE if pipe is proc.stdin else selectors.EVENT_READ)
    out, err, sent, late = bytearray(), bytearray(), 0, False
    deadline, started = time.monotonic() + SETUP_TIMEOUT_S, False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 or len(out) > ANSWERS_CAP:
                late = left <= 0
                break
            for key, _ in sel.select(left):
                pipe = key.fileobj
                if pipe is proc.stdin:
                    try:
                        sent += os.write(pipe.fileno(), request[sent:sent + 65536])
                    except BlockingIOError:  # the pipe filled since select: wait again
                        continue
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
                    if not started:  # only the runner writes here, first its start mark
                        deadline, started = time.monotonic() + run_s, True
                        chunk = chunk.removeprefix(START_MARK)
                    out += chunk
                elif len(err) < ERRORS_CAP:
                    err += chunk
    finally:
        sel.close()
    return bytes(out[:ANSWERS_CAP]), bytes(err), late, started


def _not_started(late: bool) -> None:
    if late:
        raise SandboxError(f"the sandbox's runner had not started after SETUP_TIMEOUT_S="
                           f"{SETUP_TIMEOUT_S:g} s (set-up takes ~0.1 s on an idle machine): "
                           f"{OVERLOAD_FIX}")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # exited
        return []


def _finish(proc: subprocess.Popen, isolated: bool) -> None:
    """Kill the sandbox and reap it. Pid 1 first, so that unshare reaps it: killed together,
    pid 1 would go to the nearest subreaper, which may never reap it (a zombie per call). The
    process group is the fallback, and all there is for the opt-out."""
    for _ in range(50 if isolated else 0):
        for pid in _children(proc.pid):  # unshare's only child: pid 1
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:  # pid 1 not forked yet, or still taking others down
            continue
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone, group and all
            pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


@dataclass
class Run:
    """What came back from one sandboxed run."""
    answers: bytes
    "The runner's answer lines (rewards/cases.py reads them)."
    timed_out: bool
    "True when the sandbox had not ended by itself at timeout_s and was killed."


def start_isolated(code: str, job: dict, limits: Limits, python: str | None = None,
                   cgroup: CallCgroup | None = None) -> tuple[subprocess.Popen, bytes]:
    """The sandbox's process (setpriv, then unshare, then pid 1) and the request to send it."""
    interp, nested = interpreter(python), needs_user_namespace()
    if nested and os.geteuid() == 0 and cgroup is None:
        raise SandboxError(ROOT_WITHOUT_CGROUP)
    rlimits = limits.rlimits(limits.process_limit(cgroup is not None))
    problem = rlimit_problem(rlimits)  # the runner inherits our hard limits
    if problem:
        raise SandboxError(problem)
    request = json.dumps({"python": interp.path, "binds": list(interp.binds), "nested": nested,
                          "cgroups": cgroup.procs if cgroup else [], "runner": RUNNER_SOURCE,
                          "code": code, "job": job, "rlimits": rlimits,
                          "limits": {"timeout_s": limits.timeout_s,
                                     "setup_s": SETUP_TIMEOUT_S,
                                     "disk_mb": limits.disk_mb}}).encode() + b"\n"
    proc = subprocess.Popen(_command(interp.path, nested), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/",
                            start_new_session=True)
    return proc, request


@contextlib.contextmanager
def call_cgroup(limits: Limits):
    """The call's cgroups (None where none can be made here), removed afterwards."""
    if not cgroup_bases():
        yield None
        return
    try:
        cgroup = CallCgroup(limits.memory_mb, limits.process_limit(True))
    except OSError as e:
        raise SandboxError(f"could not make the call's cgroup: {e}") from None
    try:
        yield cgroup
    finally:
        cgroup.remove()


def run_isolated(code: str, job: dict, limits: Limits, python: str | None = None) -> Run:
    """The runner's answers from a sandboxed run; SandboxError when the sandbox failed."""
    with call_cgroup(limits) as cgroup:
        proc, request = start_isolated(code, job, limits, python, cgroup)
        try:
            out, err, late, started = _exchange(proc, request, limits.timeout_s)
        finally:
            _finish(proc, isolated=True)
    lines = err.decode(errors="replace").splitlines()
    setup = [line for line in lines if line.startswith(SETUP_PREFIXES)]
    if setup:
        raise SandboxError(f"the sandbox did not start: {setup[0]}")
    if not started:
        _not_started(late)
    return Run(out, late)


def run_unisolated(code: str, job: dict, limits: Limits, python: str | None = None) -> Run:
    """The opt-out: the same runner in a plain process with the limits, in a temporary
    directory; the program can read and write the caller's files and use the network. No
    process limit: RLIMIT_NPROC counts all the caller's processes, the trainer's too."""
    rlimits = limits.rlimits(None)
    problem = rlimit_problem(rlimits)
    if problem:
        raise SandboxError(problem)
    with tempfile.TemporaryDirectory(prefix="rl-code-exec-") as workdir:
        Path(workdir, "solution.py").write_text(code, encoding="utf-8")
        Path(workdir, "cases.json").write_text(json.dumps(job), encoding="utf-8")
        proc = subprocess.Popen([interpreter(python).path, "-I", "-S", "-c", RUNNER_SOURCE],
                                cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env={}, start_new_session=True,
                                preexec_fn=functools.partial(set_limits, rlimits))
        try:
            out, _, late, started = _exchange(proc, b"", limits.timeout_s)
        finally:
            _finish(proc, isolated=False)
    if not started:
        _not_started(late)
    return Run(out, late)


def run_cases(code: str, cases: list[dict], limits: Limits = Limits(), isolated: bool = True,
              python: str | None = None) -> list[bool]:
    """Pass/fail per case of `code` (see rewards/cases.py for the forms), decided here."""
    check_tests(cases, "this row")
    job = {"timeout_s": limits.timeout_s, "cases": [public(c) for c in cases]}
    run = (run_isolated if isolated else run_unisolated)(code, job, limits, python)
    return verdicts(cases, read_answers(run.answers, cases))


PROBE = """
import os, socket
def probe():
    env = sorted(k for k in os.environ if k != "LC_CTYPE")  # python sets LC_CTYPE itself
    return [os.getuid(), socket.gethostname(), env, os.getppid(), os.path.exists("/etc")]
"""
# nobody, its own host name, no environment, a parent that is pid 1 of a new PID namespace,
# none of the host's files
PROBE_EXPECT = [65534, "sandbox", [], 1, False]
_isolation_ok: set = set()  # interpreters a probe passed on here; a failure is probed again


def isolation_problem(python: str | None = None) -> str | None:
    """None when a probe program ran isolated here, else what went wrong. Only success is
    remembered: a probe that failed on a busy machine must not disable code_exec for good."""
    if python in _isolation_ok:
        return None
    case = {"fn": "probe", "args": [], "expect": PROBE_EXPECT}
    try:
        run = run_isolated(PROBE, {"timeout_s": 10.0, "cases": [public(case)]},
                           Limits(timeout_s=10.0), python)
    except (SandboxError, OSError) as e:
        return str(e)
    answers = read_answers(run.answers, [case])
    if not verdicts([case], answers)[0]:
        return f"a probe program saw {answers.get(0)} where {PROBE_EXPECT} was due"
    _isolation_ok.add(python)
    return None


def hint(problem: str, nested: bool) -> str:
    """The usual cause of a failed probe, from the system's words, and its fix."""
    if "not found on PATH" in problem:
        return "install util-linux"
    if "runner had not started" in problem:  # the namespaces work; the machine is overloaded
        return OVERLOAD_FIX
    if "No space left on device" in problem and ("unshare" in problem or "map" in problem):
        return "user namespaces are capped at 0: sysctl -w user.max_user_namespaces=10000"
    if nested and ("unshare failed" in problem or "uid_map" in problem
                   or "setgroups" in problem):
        return ("the kernel refused a user namespace: allow them (sysctl "
                "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10 and later, "
                "user.max_user_namespaces above 0), and in a container use a seccomp profile "
                "that allows unshare and clone (docker: --security-opt seccomp=unconfined)")
    if "unshare failed" in problem:
        return ("the kernel refused namespaces to root with CAP_SYS_ADMIN: a seccomp profile "
                "blocks unshare; allow it")
    if ROOT_WITHOUT_CGROUP in problem:
        return ("give this process CAP_SYS_ADMIN, or writable memory and pids cgroups, or run "
                "it as another user")
    if "mount" in problem and "Invalid argument" in problem:
        return ("the kernel refused a mount inside the user namespace (mounts locked there, or "
                "a kernel older than 5.8); run as root with CAP_SYS_ADMIN")
    return "run as root with CAP_SYS_ADMIN, or allow unprivileged user namespaces"


def check_isolation(python: str | None = None) -> None:
    """Raise SandboxError, one line, when programs cannot be isolated on this machine."""
    problem = isolation_problem(python)
    if problem:
        raise SandboxError(
            f"code_exec cannot isolate programs on this machine: {problem}. Fix: "
            f"{hint(problem, needs_user_namespace())}. Only if the model is trusted, set args: "
            f"{{unsafe_no_isolation: true}} on the code_exec reward term to run programs "
            f"without isolation")
