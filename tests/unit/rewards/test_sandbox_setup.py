"""Starting a code_exec sandbox: the form this machine needs, the interpreter, the refusals
(one line, with the fix), the opt-out and its limits."""
import os
import sys

import pytest

import rewards.sandbox as sandbox
from rewards.sandbox import SandboxError, hint, interpreter, run_cases
from rewards.sandbox_limits import Limits

VERSION = "def solve(x):\n    import sys\n    return '%d.%d.%d' % sys.version_info[:3]\n"


def test_a_sandbox_that_cannot_start_says_what_is_missing(monkeypatch, programs):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_isolation_ok", set())
    with pytest.raises(SandboxError, match="setpriv and unshare not found on PATH"):
        run_cases(programs.solve, programs.cases)
    with pytest.raises(SandboxError, match=r"^code_exec cannot isolate .*Fix: install "
                       r"util-linux\. .*unsafe_no_isolation: true"):
        sandbox.check_isolation()
    # the opt-out runs the same runner without namespaces, verdicts still here
    assert run_cases(programs.solve, programs.cases, isolated=False) == [True]
    assert run_cases("def solve(x): return True", programs.cases, isolated=False) == [False]


@pytest.mark.parametrize("problem, nested, fix", [
    ("the sandbox did not start: unshare: unshare failed: Operation not permitted", True,
     "apparmor_restrict_unprivileged_userns=0"),
    ("the sandbox did not start: unshare: write failed /proc/self/uid_map: Operation not "
     "permitted", True, "seccomp"),
    ("the sandbox did not start: unshare: unshare failed: No space left on device", True,
     "user.max_user_namespaces=10000"),
    ("the sandbox did not start: unshare: unshare failed: Operation not permitted", False,
     "a seccomp profile blocks unshare"),
    ("the sandbox did not start: sandbox-init: mount /tmp/usr: Invalid argument", True,
     "mounts locked there"),
    ("the sandbox's runner had not started after SETUP_TIMEOUT_S=60 s", True,
     "fewer processes at once (reward.num_workers"),
])
def test_refusals_name_the_usual_fix(problem, nested, fix):
    assert fix in hint(problem, nested)


def test_root_without_cap_sys_admin_takes_the_user_namespace_form(namespaces, run_python):
    # As root in most containers: the namespaces cannot be made directly, a user one can.
    if os.geteuid() != 0:
        pytest.skip("needs root, to drop CAP_SYS_ADMIN")
    got = run_python("""
        import json
        from rewards.sandbox import isolation_problem, needs_user_namespace, run_cases
        cases = [{"fn": "solve", "args": [1], "expect": 1}]
        print(json.dumps([needs_user_namespace(), isolation_problem(),
                          run_cases("def solve(x):\\n    return x\\n", cases)]))
    """, before=["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "--"])
    assert got == [True, None, [True]]


def test_the_chosen_interpreter_runs_the_programs(form):
    # Our own base interpreter lives outside /usr (here): its prefix is bound for it.
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    for python in (None, base):
        want = interpreter(python).version
        passed = run_cases(VERSION, [{"fn": "solve", "args": [1], "expect": want}],
                           Limits(timeout_s=10.0), python=python)
        assert passed == [True], f"{python} did not run the program"


def test_a_wrong_interpreter_is_refused_with_the_fix():
    with pytest.raises(SandboxError, match=r"^code_exec python='python3' is not an executable "
                       r"absolute path; give one such as /usr/bin/python3"):
        interpreter("python3")
    with pytest.raises(SandboxError, match="python='/bin/true' does not run as a Python"):
        interpreter("/bin/true")


def test_limits_above_the_hard_limits_are_refused_with_the_fix(run_python):
    got = run_python("""
        import json, resource
        from rewards.sandbox import Limits, SandboxError, run_cases
        resource.setrlimit(resource.RLIMIT_AS, (300 << 20, 300 << 20))
        out = []
        for isolated in (True, False):
            try:
                run_cases("def solve(x):\\n    return x\\n",
                          [{"fn": "solve", "args": [1], "expect": 1}], Limits(), isolated)
            except SandboxError as e:
                out.append(str(e))
        print(json.dumps(out))
    """)
    message = (f"memory_mb=512 exceeds the hard RLIMIT_AS of {300 << 20} (ulimit -Hv); lower "
               f"memory_mb or raise that limit")
    assert got == [message, message]


def test_a_failure_in_the_runners_set_up_is_one_line_from_pid_1(form, programs, monkeypatch):
    # Anything the forked runner raises (here: a limit this Python does not know) must end the
    # child with one set-up line, never run on in pid 1's code.
    table = Limits.rlimits
    monkeypatch.setattr(Limits, "rlimits", lambda self, n: table(self, n) + [
        ["RLIMIT_BOGUS", 1, "bogus=1", "-H"]])
    monkeypatch.setattr(sandbox, "rlimit_problem", lambda rlimits: None)
    with pytest.raises(SandboxError, match=r"^the sandbox did not start: sandbox-init: runner: "
                       r"AttributeError: .*RLIMIT_BOGUS"):
        run_cases(programs.solve, programs.cases)


def test_a_case_that_cannot_start_a_process_fails_alone(score, programs):
    # One process in all, the runner: the stdin case cannot start its own; the function
    # case still runs.
    code = programs.solve + "if __name__ == '__main__':\n    print(input())\n"
    assert score(code, programs.cases + [{"stdin": "1\n", "stdout": "1\n"}], processes=1) == 0.5


NPROC = """
    # As a user who already runs more processes than `processes` (a trainer does): the opt-out
    # must not count them against the program.
    import json, subprocess
    from rewards.sandbox import Limits, run_cases
    sleepers = [subprocess.Popen(["sleep", "30"]) for _ in range(12)]
    code = "if __name__ == '__main__':\\n    print(input())\\n"
    try:
        print(json.dumps(run_cases(code, [{"stdin": "1\\n", "stdout": "1\\n"}],
                                   Limits(timeout_s=10.0, processes=4), isolated=False)))
    finally:
        for p in sleepers:
            p.kill()
"""


def test_the_opt_out_does_not_count_the_callers_other_processes(run_python):
    if os.geteuid() != 0 or not os.access(sandbox.SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root, to run as nobody, and /usr/bin/python3")
    assert run_python(NPROC, python=sandbox.SYSTEM_PYTHON, user=65534) == [True]
