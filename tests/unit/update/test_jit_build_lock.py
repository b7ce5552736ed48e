"""A JIT op's build lock that a killed process left behind does not hang the next load, and every
process builds it with the same ninja."""
import select
import subprocess
import sys
from pathlib import Path

from torch.utils.file_baton import FileBaton

from update.distributed import extensions_root, jit_build_lock, ninja_first_path


def test_a_leftover_torch_lock_is_cleared_while_the_lock_is_held(tmp_path):
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    (build / "lock").touch()  # what a loader SIGKILLed inside torch's FileBaton leaves
    with jit_build_lock(build):
        baton = FileBaton(str(build / "lock"))
        assert baton.try_acquire()  # torch's load would build or check, not wait forever
        baton.release()


def test_loaders_take_the_lock_one_at_a_time_and_a_dead_holder_releases_it(tmp_path):
    build = tmp_path / "op"
    hold = ("import os, sys, time; sys.path.insert(0, sys.argv[1]); "
            "from pathlib import Path; from update.distributed import jit_build_lock\n"
            "print('asking', flush=True)\n"
            "with jit_build_lock(Path(sys.argv[2])):\n"
            " print('held', flush=True); time.sleep(60)")
    root = str(Path(__file__).parents[3])
    holder = subprocess.Popen([sys.executable, "-c", hold, root, str(build)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert [holder.stdout.readline().strip() for _ in range(2)] == ["asking", "held"]
        waiter = subprocess.Popen([sys.executable, "-c", hold, root, str(build)],
                                  stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline().strip() == "asking"  # its imports done: timed from here
        assert not select.select([waiter.stdout], [], [], 1.0)[0]  # waits for the holder
        holder.kill()  # as kill -9 would: the lock goes with it
        assert select.select([waiter.stdout], [], [], 30.0)[0]
        assert waiter.stdout.readline().strip() == "held"
        waiter.kill()
        waiter.wait()
    finally:
        holder.kill()
        holder.wait()


def test_the_interpreters_ninja_comes_first_whatever_path_the_process_has(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    python = str(venv / "python")
    (venv / "ninja").touch()
    want = f"{venv}:/usr/bin:/bin"
    # a process without the venv on PATH, and one that has it (an activated venv, later too)
    assert ninja_first_path("/usr/bin:/bin", python) == want
    assert ninja_first_path(f"/usr/bin:{venv}:/bin", python) == want
    assert ninja_first_path(want, python) == want
    (venv / "ninja").unlink()  # no ninja of its own: PATH as it is
    assert ninja_first_path("/usr/bin:/bin", python) == "/usr/bin:/bin"


def test_each_python_environment_builds_its_extensions_in_a_directory_of_its_own(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    here, clone = extensions_root(sys.prefix), extensions_root("/tmp/a-clone/.venv")
    assert here != clone and Path(here).parent == Path(clone).parent
    assert extensions_root(sys.prefix) == here  # the same environment: the same build
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere")  # the user's choice wins
    assert extensions_root("/tmp/a-clone/.venv") == "/somewhere"
