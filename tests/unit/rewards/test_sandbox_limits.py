"""Each resource limit of the code_exec sandbox: a correct `solve` plus a hostile part that
succeeds only without that limit, so the program scores 0 only because the limit worked."""
import textwrap

SOLVE = "def solve(x):\n    return x\n"
MIB = 1 << 20


def hostile(attack: str) -> str:
    return textwrap.dedent(attack) + "\n" + SOLVE


def test_memory(score):
    # 4 GiB of untouched zero pages is granted lazily without RLIMIT_AS, even on a small host.
    assert score(hostile("x = bytearray(4 << 30)"), memory_mb=256) == 0.0
    assert score(hostile("x = bytearray(64 << 20)"), memory_mb=256) == 1.0


def test_file_size(score):
    # 40 MB fits the 64 MiB /work, so only the 16 MiB file-size limit stops it.
    attack = f"""
        with open("big", "wb") as f:
            for _ in range(40):
                f.write(b"x" * {MIB})
    """
    assert score(hostile(attack)) == 0.0


def test_work_dir_size(score):
    # Files of 15 MB each pass the file-size limit; together they overflow the 64 MiB tmpfs.
    attack = f"""
        for k in range(5):
            with open(f"part{{k}}", "wb") as f:
                f.write(b"x" * (15 * {MIB}))
    """
    assert score(hostile(attack)) == 0.0
    assert score(hostile(attack.replace("range(5)", "range(3)"))) == 1.0


def test_open_files(score):
    attack = "import os\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(200)]"
    assert score(hostile(attack)) == 0.0


def test_processes(score):
    attack = """
        import os, time
        for _ in range(200):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
    """
    assert score(hostile(attack)) == 0.0


def test_cpu_time(score):
    # 2 CPU seconds of spinning fit the 10 s wall limit: only the 1 s CPU limit stops them.
    attack = """
        import time
        while time.process_time() < 2.0:
            pass
    """
    assert score(hostile(attack), cpu_s=1.0) == 0.0



def test_first_to_go_when_the_host_runs_out_of_memory(score):
    code = "def solve(x):\n    return open('/proc/self/oom_score_adj').read().strip()\n"
    assert score(code, [{"fn": "solve", "args": [1], "expect": "1000"}]) == 1.0
