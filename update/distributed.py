"""The trainer's processes: joining the process group (gloo on CPU, NCCL on GPU) and loading
DeepSpeed's JIT-built CPU comm op without two processes building it at once."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer's process group (gloo on CPU, NCCL on GPU)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    import deepspeed

    if device_name() == "cpu":
        load_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if device_name() == "cuda" else "gloo")


def load_shm_comm_op() -> None:
    """Load DeepSpeed's CPU shared-memory comm op (a JIT build, cached in this Python
    environment's extensions directory, `extensions_root`, which stays TORCH_EXTENSIONS_DIR for
    the process's later builds) before deepspeed.init_distributed asks for it, under
    `jit_build_lock`; DeepSpeed then takes the loaded module from its cache."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    from torch.utils.cpp_extension import _get_build_directory

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_root()
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja_first_path(path, sys.executable)
    try:
        with jit_build_lock(Path(_get_build_directory(builder.name, verbose=False))):
            builder.load()
    finally:
        os.environ["PATH"] = path


def extensions_root(prefix: str = sys.prefix) -> str:
    """Where torch builds JIT extensions for the Python environment at `prefix`:
    TORCH_EXTENSIONS_DIR when set, else a directory of its own under torch's default
    (~/.cache/torch_extensions/env-<hash of the prefix>). A build's commands name the
    environment's include paths, so two environments sharing torch's one directory (a clone's
    venv and the working tree's) rebuilt the comm op in turn: ~20 s on 2 cores, in the first
    trainer of the next run in the other environment."""
    import hashlib

    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    key = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:12]
    return os.path.join(get_default_build_root(), f"env-{key}")


def ninja_first_path(path: str, executable: str) -> str:
    """PATH with the interpreter's own directory first when it holds a `ninja` (the pip package
    DeepSpeed installs): torch builds with the first `ninja` on PATH, and two ninja versions (a
    venv's 1.13 and a system's 1.11) cannot read each other's build log, so each rebuilt the op
    after the other (21 s on 2 cores, several times a suite: processes with and without an
    activated venv)."""
    here = str(Path(executable).parent)
    if not (Path(here) / "ninja").exists():
        return path
    return os.pathsep.join([here, *[p for p in path.split(os.pathsep) if p and p != here]])


@contextmanager
def jit_build_lock(build_dir: Path):
    """Hold an exclusive lock on `build_dir`'s JIT build and clear torch's own lock file there.
    Torch's lock (cpp_extension's FileBaton: a file that exists while a process builds or
    checks the build) stays behind when that process is killed, and then every later load
    waits for it forever: a run killed during its start-up hung every run after it in
    init_distributed. This lock is flock's, which dies with its holder, and every loader here
    holds it, so a torch lock file found while holding it is such a leftover."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".rlstack-lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield
