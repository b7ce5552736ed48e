"""A model-written program is hostile: each test pairs a correct `solve` with one attack that
only a layer of the sandbox stops, so the program scores 0 (or leaves nothing) only because
that layer worked. The layers are named in rewards/sandbox.py and the README."""
import os
import subprocess
import tempfile
import textwrap
import time

import pytest

import rewards.sandbox as sandbox
from rewards.sandbox import (Limits, SandboxError, extract_code, isolation_problem, run_cases,
                             start_isolated)

SOLVE = "def solve(x):\n    return x\n"
CASES = [{"fn": "solve", "args": [1], "expect": 1}]


def hostile(attack: str) -> str:
    """`attack` at import time, then a correct solve: it loads only if the attack succeeded."""
    return textwrap.dedent(attack) + "\n" + SOLVE


def test_verdicts_for_both_case_forms(score):
    code = SOLVE + "if __name__ == '__main__':\n    print(int(input()) * 2)\n"
    cases = CASES + [{"fn": "solve", "args": [[1, 2.0]], "expect": [1, 2.0000001]},
                     {"fn": "solve", "args": [2], "expect": 3},
                     {"stdin": "21\n", "stdout": "42  \n\n"}, {"stdin": "1\n", "stdout": "3\n"}]
    assert score(code, cases) == pytest.approx(3 / 5)
    assert score("def solve(x):\n    return x + 1\n") == 0.0


def test_the_program_is_nobody_with_no_environment_on_its_own_host(score, monkeypatch):
    monkeypatch.setenv("RLSTACK_SANDBOX_PROBE", "visible")
    assert score(SOLVE) == 1.0
    assert score(hostile("import os\nassert os.environ['RLSTACK_SANDBOX_PROBE']")) == 0.0
    monkeypatch.setattr(sandbox, "_isolation_ok", False)  # probe now, not from memory
    assert isolation_problem() is None


# ---------------------------------------------------------------- the file system (mount ns)
def test_no_write_outside_the_work_dir(score, host_dir):
    assert score(hostile(f"open({str(host_dir / 'pwned')!r}, 'w').write('x')")) == 0.0
    assert not (host_dir / "pwned").exists()


def test_no_mkdir_or_rename_outside_the_work_dir(score, host_dir):
    (host_dir / "victim").write_text("x")
    assert score(hostile(f"import os\nos.mkdir({str(host_dir / 'made')!r})")) == 0.0
    moved = f"import os\nos.rename({str(host_dir / 'victim')!r}, {str(host_dir / 'moved')!r})"
    assert score(hostile(moved)) == 0.0
    assert sorted(p.name for p in host_dir.iterdir()) == ["victim"]


def test_no_reading_host_files(score, host_dir):
    host_dir.chmod(0o755)
    secret = host_dir / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    assert score(hostile(f"assert open({str(secret)!r}).read() == 's3cret'")) == 0.0


def test_no_reading_files_under_root(score):
    if os.geteuid() != 0 or not os.access("/root", os.W_OK):
        pytest.skip("needs root to put a file under /root")
    with tempfile.NamedTemporaryFile("w", dir="/root", prefix="rlstack-sandbox-") as f:
        f.write("s3cret")
        f.flush()
        os.chmod(f.name, 0o644)
        assert score(hostile(f"assert open({f.name!r}).read() == 's3cret'")) == 0.0


# ---------------------------------------------------------------- network, processes, users
def test_no_connection_to_the_hosts_loopback(score, listener):
    port, hits = listener
    code = hostile(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert score(code) == 0.0
    assert hits == []


def test_no_reading_another_process_environment(score):
    # The holder runs as the very user the program runs as on the host (nobody when we are
    # root), so file permissions would let the read through: only the PID namespace and its
    # own /proc stop it.
    holder = subprocess.Popen(["/bin/sleep", "30"], env={"RLSTACK_SECRET": "hunter2"},
                              user=65534 if os.geteuid() == 0 else None)
    try:
        attack = """
            import os
            found = False
            for pid in filter(str.isdigit, os.listdir('/proc')):
                try:
                    found |= b'RLSTACK_SECRET=' in open(f'/proc/{pid}/environ', 'rb').read()
                except OSError:
                    pass
            assert found
        """
        assert score(hostile(attack)) == 0.0
    finally:
        holder.kill()
        holder.wait()


DETACH = """
    import _posixsubprocess, os, time
    # A child in its own session, through the low-level call subprocess uses (no audit event,
    # no subprocess.Popen), which leaves a grandchild; and a classic double fork with setsid.
    # This is the 3.11 signature: on another, the program fails to load and the test fails.
    r, w = os.pipe()
    _posixsubprocess.fork_exec([b"/bin/sh", b"-c", b"sleep 97.531 & exec sleep 97.532"],
                               [b"/bin/sh"], True, (w,), None, None, -1, -1, -1, -1, -1, -1,
                               r, w, True, True, -1, None, None, None, -1, None, False)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "97.533"])
        os._exit(0)
    def running():
        seen = b""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                seen += open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                pass
        return all(m in seen for m in (b"97.531", b"97.532", b"97.533"))
    end = time.time() + 5
    while not running():
        assert time.time() < end, "the detached sleepers did not start"
        time.sleep(0.02)
"""


def test_detached_children_and_grandchildren_do_not_outlive_the_call(score, leftovers):
    assert score(hostile(DETACH)) == 1.0  # 1: they did start, so their absence below counts
    assert leftovers(["97.531", "97.532", "97.533"]) == []


def test_no_nested_user_namespace(score):
    attack = "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0"
    assert score(hostile(attack)) == 0.0


def test_a_program_that_never_returns_is_stopped_at_the_timeout(score):
    start = time.monotonic()
    code = "import time\ndef solve(x):\n    time.sleep(60)\n"  # no CPU used: no CPU limit
    assert score(code, timeout_s=1.0) == 0.0
    # at our deadline, not pid 1's own 2 s later
    assert time.monotonic() - start < 1.0 + 1.5


def test_pid_1_keeps_its_own_deadline_when_nobody_kills_it(namespaces, leftovers):
    # As if the parent had died before it could kill anything: nobody reads, nobody kills.
    code = hostile(DETACH) + "import time\ntime.sleep(60)\n"
    job = {"timeout_s": 1.0, "cases": [{"fn": "solve", "args": [1]}]}
    proc, request = start_isolated(code, job, Limits(timeout_s=1.0))
    markers = ["97.531", "97.532", "97.533"]
    try:
        proc.stdin.write(request)
        proc.stdin.close()
        end = time.monotonic() + 5
        while len(leftovers.pids_with(markers)) < 3 and time.monotonic() < end:
            time.sleep(0.02)
        assert len(leftovers.pids_with(markers)) == 3, "the sleepers never started"
        proc.wait(timeout=15)  # pid 1 gives up at 1 s + its grace, taking the namespace along
        assert leftovers(markers) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ---------------------------------------------------------------- verdicts outside the sandbox
TAMPER = {
    "always-equal object": """
        class Any:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
        def solve(x): return Any()
    """,
    "a bool for an int": "def solve(x): return True",
    "json patched": """
        import json, json.encoder
        forged = '{"i": 0, "value": true, "passed": true, "reward": 100}'
        json.dumps = lambda *a, **k: forged
        json.JSONEncoder.encode = lambda self, o: forged
        def solve(x): return 2
    """,
    "builtins patched": """
        import builtins
        builtins.isinstance = lambda *a: True
        builtins.getattr = lambda *a: (lambda *b: 1.0000001e300)
        builtins.len = lambda *a: 0
        def solve(x): return 2
    """,
    "sys patched": """
        import atexit, os, sys
        sys.modules["json"] = type(sys)("json")
        sys.exit = lambda *a: None
        def forge():  # into every open descriptor, the runner's answers among them
            for fd in range(64):
                try:
                    os.write(fd, b'{"i": 0, "value": true}\\n{"i": 0, "passed": true}\\n')
                except OSError:
                    pass
        forge()
        atexit.register(forge)
        def solve(x): return 2
    """,
    "the runner's own state": """
        import gc
        for obj in gc.get_objects():
            if getattr(obj, "__name__", "") == "answer":
                for line in ('PASS', '{"i": 0, "passed": true}', '{"i": 0.0, "value": 1}',
                             '{"i": true, "value": 1}', '{"i": 0, "value": 1, "x": 0}'):
                    obj(line)
        def solve(x): return 2
    """,
    "a search for the expected value": """
        import glob, os, re
        paths = glob.glob("/work/**", recursive=True) + glob.glob("/tmp/**", recursive=True)
        paths += glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ")
        blobs = []
        for path in paths:
            try:
                blobs.append(open(path, "rb").read(1 << 20))
            except OSError:
                pass
        hits = [m for b in blobs for m in re.findall(rb"expected-[0-9a-f]{8}", b)]
        def solve(x): return hits[0].decode() if hits else "not found"
    """,
}


@pytest.mark.parametrize("attack", TAMPER, ids=list(TAMPER))
def test_tampering_scores_nothing_for_a_wrong_answer(score, attack):
    cases = [{"fn": "solve", "args": [1], "expect": 1}]
    if attack == "a search for the expected value":
        cases = [{"fn": "solve", "args": [1], "expect": "expected-5eb7c0de"}]
    assert score(textwrap.dedent(TAMPER[attack]), cases) == 0.0


def test_forged_answer_lines_never_lift_the_reward_above_one(score):
    forge = """
        import os, sys
        for k in range(100):
            os.write(1, f'{{"i": {k}, "value": 1}}\\n'.encode())
            print(f'{{"i": {k}, "value": 1}}')
    """
    assert score(hostile(forge)) == 1.0
    cases = CASES + [{"fn": "solve", "args": [2], "expect": 3}]
    assert score(hostile(forge), cases) == 0.5


def test_a_sandbox_that_cannot_start_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_isolation_ok", False)
    with pytest.raises(SandboxError, match="setpriv and unshare not found on PATH"):
        run_cases(SOLVE, CASES)
    with pytest.raises(SandboxError, match=r"cannot isolate .*unsafe_no_isolation: true"):
        sandbox.check_isolation()
    # the opt-out runs the same runner without namespaces, verdicts still here
    assert run_cases(SOLVE, CASES, isolated=False) == [True]
    assert run_cases("def solve(x): return True", CASES, isolated=False) == [False]


def test_extract_code():
    assert extract_code("x\n```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("plain = 1") == "plain = 1"
