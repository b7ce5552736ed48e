"""How a code_exec sandbox ends: nothing of it outlives the call (detached processes, zombies),
the caller's deadline holds and runs from the runner's start, pid 1 keeps its own, and a
program that has answered does not hold the call open."""
import subprocess
import time

import pytest

import rewards.sandbox as sandbox
from rewards.sandbox import (Limits, SandboxError, call_cgroup, run_cases, run_isolated,
                             start_isolated)

MARKERS = ["97.531", "97.532", "97.533", "97.534"]
DETACH = """
    import os, subprocess, time
    # Children in sessions of their own, started three ways, leaving a grandchild too: through
    # subprocess, through posix_spawn (no fork in Python at all), and a classic double fork.
    subprocess.Popen(["/bin/sh", "-c", "sleep 97.531 & exec sleep 97.532"],
                     start_new_session=True)
    os.posix_spawn("/bin/sleep", ["sleep", "97.533"], {}, setsid=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "97.534"])
        os._exit(0)
    def running():
        seen = b""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                seen += open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                pass
        return all(m in seen for m in (b"97.531", b"97.532", b"97.533", b"97.534"))
    end = time.time() + 5
    while not running():
        assert time.time() < end, "the detached sleepers did not start"
        time.sleep(0.02)
"""
HANG = "import time\ndef solve(x):\n    time.sleep(60)\n"  # no CPU used: no CPU limit
JOB = {"timeout_s": 1.0, "cases": [{"fn": "solve", "args": [1]}]}


def test_detached_children_and_grandchildren_do_not_outlive_the_call(score, programs,
                                                                     leftovers):
    assert score(programs.hostile(DETACH)) == 1.0  # 1: they did start, so their absence counts
    assert leftovers(MARKERS) == []


def test_a_program_that_never_returns_is_stopped_at_the_timeout(form):
    run = run_isolated(HANG, JOB, Limits(timeout_s=1.0))
    assert run.timed_out and run.answers == b""


def test_a_program_that_answered_does_not_hold_the_call(form, programs):
    # A non-daemon thread (and an atexit hook) would keep the interpreter alive past its
    # answers: the runner exits without waiting, so the sandbox ends by itself. The deadline
    # leaves room for a loaded machine (3 s ran out in CI beside the suite's background runs)
    # and stays far below the holds.
    code = """
        import atexit, threading, time
        threading.Thread(target=time.sleep, args=(300,)).start()
        atexit.register(time.sleep, 300)
    """
    job = {"timeout_s": 30.0, "cases": [{"fn": "solve", "args": [1]}]}
    run = run_isolated(programs.hostile(code), job, Limits(timeout_s=30.0))
    assert run.answers == b'{"i": 0, "value": 1}\n'
    assert not run.timed_out


def test_the_timeout_runs_from_the_runners_start_not_the_set_up():
    # A stand-in whose set-up (before its first byte, the runner's start mark) outlasts the
    # 0.5 s timeout, then answers at once: the answer counts. Under the suite's load the real
    # set-up once took the whole 5 s, and a right program scored 0.
    proc = subprocess.Popen(["/bin/sh", "-c", "sleep 0.6; echo; echo answer"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err, late, started = sandbox._exchange(proc, b"", run_s=0.5)
    finally:
        proc.kill()
        proc.wait()
    assert (out, late, started) == (b"answer\n", False, True)


@pytest.mark.parametrize("isolated", [True, False])
def test_a_set_up_past_its_allowance_is_a_sandbox_error_not_a_failed_program(
        isolated, monkeypatch, request):
    if isolated:  # the opt-out needs no namespaces: it runs where they cannot be made too
        request.getfixturevalue("namespaces")
    monkeypatch.setattr(sandbox, "SETUP_TIMEOUT_S", 0.0)
    with pytest.raises(SandboxError, match="runner had not started after SETUP_TIMEOUT_S=0 s"):
        run_cases("def solve(x):\n    return x\n", [{"fn": "solve", "args": [1], "expect": 1}],
                  isolated=isolated)


ZOMBIES = """
    # A subreaper, as a container's init or a process supervisor is: what the sandbox leaves
    # unreaped when killed at the timeout would come here.
    import ctypes, json, os
    assert ctypes.CDLL(None).prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    import rewards.sandbox as sandbox
    from rewards.sandbox import Limits, run_cases
    sandbox.needs_user_namespace = lambda: {form!r} == "user"
    verdicts = [run_cases({hang!r}, [{{"fn": "solve", "args": [1], "expect": 1}}],
                          Limits(timeout_s=1.0)) for _ in range(2)]
    print(json.dumps([verdicts, open(f"/proc/self/task/{{os.getpid()}}/children").read()]))
"""


def test_timed_out_calls_leave_no_zombies(form, run_python):
    verdicts, children = run_python(ZOMBIES.format(form=form, hang=HANG))
    assert verdicts == [[False], [False]]
    assert children.split() == []


def test_pid_1_keeps_its_own_deadline_when_nobody_kills_it(form, programs, leftovers,
                                                           monkeypatch):
    # As if the parent had died before it could kill anything: nobody reads, nobody kills.
    # pid 1 waits, from the runner's start, its set-up allowance + the timeout + its grace:
    # 0 + 1 + 2 s here
    monkeypatch.setattr(sandbox, "SETUP_TIMEOUT_S", 0.0)
    code = programs.hostile(DETACH) + "import time\ntime.sleep(60)\n"
    with call_cgroup(Limits(timeout_s=1.0)) as cgroup:
        proc, request = start_isolated(code, JOB, Limits(timeout_s=1.0), cgroup=cgroup)
        watch_pid_1_alone(proc, request, leftovers)


def watch_pid_1_alone(proc, request, leftovers):
    """Send the request, then neither read nor kill: the sleepers start, and go with pid 1."""
    try:
        proc.stdin.write(request)
        proc.stdin.close()
        end = time.monotonic() + 5
        while len(leftovers.pids_with(MARKERS)) < 4 and time.monotonic() < end:
            time.sleep(0.02)
        assert len(leftovers.pids_with(MARKERS)) == 4, "the sleepers never started"
        proc.wait(timeout=15)  # pid 1 gives up at 1 s + its grace, taking the namespace along
        assert leftovers(MARKERS) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
