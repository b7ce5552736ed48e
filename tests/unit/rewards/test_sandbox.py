"""A model-written program is hostile: each test pairs a correct `solve` with one attack that
only a layer of the sandbox stops, so the program scores 0 (or leaves nothing) only because
that layer worked. The layers are named in rewards/sandbox.py and docs/rewards.md. Every test that
scores runs in both forms of the sandbox (see the `form` fixture)."""
import os
import subprocess
import tempfile
import uuid

import pytest

import rewards.sandbox as sandbox
from rewards.sandbox import isolation_problem


def test_verdicts_for_both_case_forms(score, programs):
    code = programs.solve + "if __name__ == '__main__':\n    print(int(input()) * 2)\n"
    cases = programs.cases + [
        {"fn": "solve", "args": [[1, 2.0]], "expect": [1, 2.0000001]},
        {"fn": "solve", "args": [2], "expect": 3},
        {"stdin": "21\n", "stdout": "42  \n\n"}, {"stdin": "1\n", "stdout": "3\n"}]
    assert score(code, cases) == pytest.approx(3 / 5)
    assert score("def solve(x):\n    return x + 1\n") == 0.0


def test_the_program_is_nobody_with_no_environment_on_its_own_host(score, programs,
                                                                   monkeypatch):
    monkeypatch.setenv("RLSTACK_SANDBOX_PROBE", "visible")
    assert score(programs.solve) == 1.0
    assert score(programs.hostile("import os\nassert os.environ['RLSTACK_SANDBOX_PROBE']")) == 0
    monkeypatch.setattr(sandbox, "_isolation_ok", set())  # probe now, not from memory
    assert isolation_problem() is None


# ---------------------------------------------------------------- the file system (mount ns)
def test_no_write_outside_the_work_dir(score, programs, host_dir):
    assert score(programs.hostile(f"open({str(host_dir / 'pwned')!r}, 'w').write('x')")) == 0
    assert not (host_dir / "pwned").exists()


def test_no_mkdir_or_rename_outside_the_work_dir(score, programs, host_dir):
    (host_dir / "victim").write_text("x")
    assert score(programs.hostile(f"import os\nos.mkdir({str(host_dir / 'made')!r})")) == 0.0
    moved = f"import os\nos.rename({str(host_dir / 'victim')!r}, {str(host_dir / 'moved')!r})"
    assert score(programs.hostile(moved)) == 0.0
    assert sorted(p.name for p in host_dir.iterdir()) == ["victim"]


def test_usr_is_read_only(score, programs):
    # In the --user form the program is the caller's own host user, root here, which owns
    # /usr: only the read-only bind keeps it from writing there.
    target = f"/usr/lib/rlstack-sandbox-{uuid.uuid4().hex[:8]}"
    try:
        assert score(programs.hostile(f"open({target!r}, 'w').write('x')")) == 0.0
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.unlink(target)


def test_no_reading_host_files(score, programs, host_dir):
    host_dir.chmod(0o755)
    secret = host_dir / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    assert score(programs.hostile(f"assert open({str(secret)!r}).read() == 's3cret'")) == 0.0


def test_no_reading_files_under_root(score, programs):
    if os.geteuid() != 0 or not os.access("/root", os.W_OK):
        pytest.skip("needs root to put a file under /root")
    with tempfile.NamedTemporaryFile("w", dir="/root", prefix="rlstack-sandbox-") as f:
        f.write("s3cret")
        f.flush()
        os.chmod(f.name, 0o644)
        assert score(programs.hostile(f"assert open({f.name!r}).read() == 's3cret'")) == 0.0


SUBMOUNT = """
    # A tmpfs on /usr/share/doc, in a mount namespace of this process only (as a GPU
    # container's toolkit binds files under /usr): in the --user form the kernel locks it.
    import json, os, subprocess
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "rlstack-test", "/usr/share/doc"],
                   check=True)
    open("/usr/share/doc/marker", "w").close()
    import rewards.sandbox as sandbox
    from rewards.sandbox import run_cases
    sandbox.needs_user_namespace = lambda: {form!r} == "user"
    cases = [{{"fn": "solve", "args": [1], "expect": 1}}]
    seen = "import os\\nassert os.path.exists('/usr/share/doc/marker')\\n"
    write = seen + "open('/usr/share/doc/pwned', 'w').write('x')\\n"
    solve = "def solve(x):\\n    return x\\n"
    print(json.dumps([run_cases(seen + solve, cases), run_cases(write + solve, cases),
                      os.listdir("/usr/share/doc")]))
"""


def test_mounts_under_usr_come_along_read_only(form, run_python):
    if os.geteuid() != 0 or not os.path.isdir("/usr/share/doc"):
        pytest.skip("needs root, to mount a tmpfs on /usr/share/doc in a private namespace")
    seen, written, files = run_python(SUBMOUNT.format(form=form),
                                      before=["unshare", "--mount", "--propagation", "private"])
    assert seen == [True]  # the mount is there, as on the host
    assert written == [False] and files == ["marker"]


# ---------------------------------------------------------------- network, processes, users
def test_no_connection_to_the_hosts_loopback(score, programs, listener):
    port, hits = listener
    attack = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
    assert score(programs.hostile(attack)) == 0.0
    assert hits == []


def test_no_reading_another_process_environment(score, programs, form):
    # The holder runs as the very user the program runs as on the host (nobody in the root
    # form, the caller in the --user form), so file permissions would let the read through:
    # only the PID namespace and its own /proc stop it.
    holder = subprocess.Popen(["/bin/sleep", "30"], env={"RLSTACK_SECRET": "hunter2"},
                              user=65534 if form == "root" else None)
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
        assert score(programs.hostile(attack)) == 0.0
    finally:
        holder.kill()
        holder.wait()


def test_pid_1_is_hidden_from_the_program(score, programs):
    # Its command line is readable by anyone in a plain proc: hidepid=invisible hides it.
    assert score(programs.hostile("assert open('/proc/1/cmdline', 'rb').read()")) == 0.0


def test_pid_1_descriptors_are_out_of_reach(score, programs):
    # In the --user form pid 1 is the program's own host user: what keeps its descriptors
    # (and memory) from the program is that pid 1 holds capabilities in a user namespace above
    # the program's, which the kernel's ptrace check requires of the caller too (pid 1 is also
    # non-dumpable, which alone would do the same).
    assert score(programs.hostile("import os\nos.open('/proc/1/fd/0', os.O_RDONLY)")) == 0.0


SIGNAL_PID_1 = """
    import os, signal, time
    for sig in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGALRM", "SIGCHLD",
                "SIGSTOP", "SIGKILL"):
        try:
            os.kill(1, getattr(signal, sig))
        except OSError:  # the root form: another user's process
            pass
    time.sleep(0.3)  # time for pid 1 to act on them, were they delivered
"""


def test_signals_to_pid_1_change_nothing(score, programs):
    # In the --user form the program may signal pid 1 (the same host user): the kernel drops
    # what pid 1 has no handler for. A right answer stays right, a wrong one just wrong.
    assert score(programs.hostile(SIGNAL_PID_1)) == 1.0
    assert score(programs.hostile(SIGNAL_PID_1).replace("return x", "return 0")) == 0.0


def test_no_nested_user_namespace(score, programs):
    attack = "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0"
    assert score(programs.hostile(attack)) == 0.0


KEYRING = """
    # A key in a session keyring of this process's own, as a caller's credentials might be.
    import ctypes, json, os
    libc = ctypes.CDLL(None)
    nr = {{"x86_64": (250, 248), "aarch64": (219, 217)}}[os.uname().machine]  # keyctl, add_key
    libc.syscall(nr[0], 1, None)  # KEYCTL_JOIN_SESSION_KEYRING: a new one
    assert libc.syscall(nr[1], b"user", b"rlstack-test", b"s3cret", 6, -3) > 0
    import rewards.sandbox as sandbox
    from rewards.sandbox import run_cases
    sandbox.needs_user_namespace = lambda: {form!r} == "user"
    attack = '''
    import ctypes, os
    libc = ctypes.CDLL(None)
    nr = {{"x86_64": 250, "aarch64": 219}}[os.uname().machine]
    key = libc.syscall(nr, 10, -3, b"user", b"rlstack-test", 0)  # KEYCTL_SEARCH the session's
    buf = ctypes.create_string_buffer(16)
    assert key > 0 and libc.syscall(nr, 11, key, buf, 16) == 6 and buf.raw[:6] == b"s3cret"
    def solve(x):
        return x
    '''
    print(json.dumps(run_cases(attack, [{{"fn": "solve", "args": [1], "expect": 1}}])))
"""


def test_no_access_to_the_callers_session_keyring(form, run_python):
    if not os.path.exists("/proc/keys"):
        pytest.skip("a kernel without keyrings")
    assert run_python(KEYRING.format(form=form)) == [False]
