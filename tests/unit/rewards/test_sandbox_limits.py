"""Each resource limit of the code_exec sandbox: a correct `solve` plus a hostile part that
succeeds only without that limit, so the program scores 0 only because the limit worked; where
it helps, the same program under the limit shows the attack itself runs."""
import os

import pytest

import rewards.sandbox as sandbox
from rewards.sandbox import SandboxError
from rewards.sandbox_limits import cgroup_bases

MIB = 1 << 20


def test_address_space(score, programs):
    # 4 GiB mapped and never touched: granted lazily without RLIMIT_AS, even on a small host,
    # and charged to no cgroup; only the address-space limit refuses it.
    attack = "import mmap\nm = mmap.mmap(-1, {})"
    assert score(programs.hostile(attack.format(4 << 30)), memory_mb=256) == 0.0
    assert score(programs.hostile(attack.format(64 << 20)), memory_mb=256) == 1.0


TOGETHER = """
    # Three processes, each under the per-process limit, holding {mb} MB of touched memory at
    # the same time (a pipe for a barrier): too much together only for a per-call total.
    import os, select
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    kids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            os.close(hold_w)
            block = bytearray({mb} << 20)  # zero-filled: every page touched
            os.write(ready_w, b"x")
            os.read(hold_r, 1)  # until the parent lets go: closes hold_w
            os._exit(0)
        kids.append(pid)
    got = b""
    while len(got) < 3 and all(os.waitpid(k, os.WNOHANG) == (0, 0) for k in kids):
        if select.select([ready_r], [], [], 0.05)[0]:
            got += os.read(ready_r, 3)
    os.close(hold_w)
    assert got == b"xxx" and all(os.waitpid(k, 0)[1] == 0 for k in kids)
"""


def test_memory_of_all_processes_together(score, programs):
    if not cgroup_bases():
        pytest.skip("no per-call cgroup here: memory_mb is per process (see docs/rewards.md)")
    assert score(programs.hostile(TOGETHER.format(mb=100)), memory_mb=256) == 0.0
    assert score(programs.hostile(TOGETHER.format(mb=30)), memory_mb=256) == 1.0


def test_file_size(score, programs):
    # 40 MB fits the 64 MiB /work, so only the 16 MiB file-size limit stops it.
    attack = f"""
        with open("big", "wb") as f:
            for _ in range(40):
                f.write(b"x" * {MIB})
    """
    assert score(programs.hostile(attack)) == 0.0


def test_work_dir_size(score, programs):
    # Files of 15 MB each pass the file-size limit; together they overflow the 64 MiB tmpfs.
    attack = f"""
        for k in range(5):
            with open(f"part{{k}}", "wb") as f:
                f.write(b"x" * (15 * {MIB}))
    """
    assert score(programs.hostile(attack)) == 0.0
    assert score(programs.hostile(attack.replace("range(5)", "range(3)"))) == 1.0


def test_open_files(score, programs):
    attack = "import os\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(200)]"
    assert score(programs.hostile(attack)) == 0.0


FORK = """
    import os, time
    for _ in range({n}):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
"""


def test_processes(score, programs):
    assert score(programs.hostile(FORK.format(n=200))) == 0.0
    assert score(programs.hostile(FORK.format(n=4))) == 1.0


def test_fewer_processes_by_default_without_a_cgroup(score, programs, form, monkeypatch):
    # memory_mb is then per process: 8 of them bound the call to 8 x memory_mb.
    monkeypatch.setattr(sandbox, "cgroup_bases", lambda: ())
    if form == "user" and os.geteuid() == 0:
        # There the program is the host's root user, whom RLIMIT_NPROC never binds: refused.
        with pytest.raises(SandboxError, match="exempts from the process limit"):
            score(programs.solve)
        return
    assert score(programs.hostile(FORK.format(n=12))) == 0.0
    assert score(programs.hostile(FORK.format(n=4))) == 1.0


def test_cpu_time(score, programs):
    # 2 CPU seconds of spinning fit the 10 s wall limit: only the 1 s CPU limit stops them.
    attack = """
        import time
        while time.process_time() < 2.0:
            pass
    """
    assert score(programs.hostile(attack), cpu_s=1.0) == 0.0


OOM_SCORE = """
def solve(x):
    start = open("/proc/self/oom_score_adj").read().strip()
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
        refused = False
    except OSError:
        refused = True
    return [start, refused]
"""


def test_first_to_go_when_memory_runs_out(score):
    # What holds: 1000 to start with, and no way below 0, where the host's own processes are
    # (that needs CAP_SYS_RESOURCE). Back to 0 it may go, as any process may.
    cases = [{"fn": "solve", "args": [1], "expect": ["1000", True]}]
    assert score(OOM_SCORE, cases) == 1.0
