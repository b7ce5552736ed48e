"""Resource limits of a code_exec call: per process (rlimits, set by the runner on itself) and,
where this machine lets us make cgroups, for the call as a whole.

A per-call cgroup (cgroup v1 with writable memory and pids hierarchies, which root has, or a
cgroup v2 whose own subtree already delegates both) makes memory_mb the total of all the call's
processes and files in /work and /tmp, and bounds the process count. Without one, memory_mb is
per process, so the default process limit is lower: the call holds at most 8 x memory_mb.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import time
from dataclasses import dataclass

PROCESSES_WITH_CGROUP = 64
PROCESSES_WITHOUT_CGROUP = 8  # x memory_mb (512 by default): 4 GiB at most without a cgroup
PREFIX = "rl-code-exec-"  # per-call cgroups are PREFIX<creator pid>-<n>
MIB = 1 << 20
_calls = itertools.count()


@dataclass(frozen=True)
class Limits:
    """The limits of one code_exec call; code_exec's args set timeout_s, memory_mb, cpu_s."""
    timeout_s: float = 5.0
    "Wall-clock limit of one program's run over all its cases; later answers fail."
    memory_mb: int = 512
    "Memory of the whole call with a cgroup, else address space per process (RLIMIT_AS)."
    cpu_s: float | None = None
    "CPU seconds per process (RLIMIT_CPU); None: timeout_s."
    file_mb: int = 16
    "Largest file a process may write (RLIMIT_FSIZE)."
    disk_mb: int = 64
    "Size of each of the tmpfs /work and /tmp (they live in memory)."
    open_files: int = 64
    "Open files per process (RLIMIT_NOFILE)."
    processes: int | None = None
    ("Processes and threads of the program together; None: 64 with a per-call cgroup, else 8 "
     "(see the module docstring).")

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "cpu_s", "file_mb", "disk_mb", "open_files",
                     "processes"):
            value = getattr(self, name)
            if value is None and name in ("cpu_s", "processes"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"code_exec {name}={value!r}: must be a number > 0")
        if self.memory_mb < 64:
            raise ValueError(f"code_exec memory_mb={self.memory_mb}: the interpreter alone "
                             f"needs more; give at least 64")

    def process_limit(self, cgroup: bool) -> int:
        """`processes`, or its default for a call with (or without) a per-call cgroup."""
        if self.processes is not None:
            return int(self.processes)
        return PROCESSES_WITH_CGROUP if cgroup else PROCESSES_WITHOUT_CGROUP

    def rlimits(self, processes: int | None) -> list[list]:
        """[resource, value, what set it, its ulimit flag] per rlimit of the runner: the one
        table for the sandbox's pid 1 and the opt-out. processes None: no RLIMIT_NPROC."""
        cpu = self.timeout_s if self.cpu_s is None else self.cpu_s
        table = [["RLIMIT_CPU", max(1, math.ceil(cpu)), f"cpu_s={cpu}", "-Ht"],
                 ["RLIMIT_AS", int(self.memory_mb * MIB), f"memory_mb={self.memory_mb}", "-Hv"],
                 ["RLIMIT_FSIZE", int(self.file_mb * MIB), f"file_mb={self.file_mb}", "-Hf"],
                 ["RLIMIT_NOFILE", int(self.open_files), f"open_files={self.open_files}", "-Hn"],
                 ["RLIMIT_CORE", 0, "no core files", "-Hc"]]
        if processes is not None:
            table.append(["RLIMIT_NPROC", processes, f"processes={processes}", "-Hu"])
        return table


def _mounts() -> list[tuple[str, str, str, set]]:
    """(root, mount point, fs type, super options) of each mount, from mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, fs = left.split(), right.split()
            out.append((fields[3], fields[4], fs[0], set(fs[2].split(","))))
    return out


def _dir(mount_root: str, point: str, own: str) -> str | None:
    """Our cgroup's directory under a hierarchy mounted at `point` from `mount_root`."""
    if mount_root == "/":
        return point + own.rstrip("/")
    if own == mount_root or own.startswith(mount_root + "/"):
        return point + own[len(mount_root):]
    return None


@functools.lru_cache(maxsize=None)
def cgroup_bases() -> tuple[tuple[str, str], ...]:
    """((kind, directory), ...) where this process may make per-call cgroups: ("memory", ..),
    ("pids", ..) on cgroup v1, or one ("v2", ..); () when it may not."""
    try:
        with open("/proc/self/cgroup") as f:
            own = dict((ctl, path) for _, ctls, path in (line.rstrip("\n").split(":", 2)
                                                         for line in f) for ctl in ctls.split(","))
        mounts = _mounts()
    except OSError:
        return ()
    v1 = []
    for kind in ("memory", "pids"):
        for root, point, fs, opts in mounts:
            path = _dir(root, point, own.get(kind, "")) if fs == "cgroup" and kind in opts else None
            if path and kind in own and os.access(path, os.W_OK):
                v1.append((kind, path))
                break
    if len(v1) == 2:
        return tuple(v1)
    for root, point, fs, _ in mounts:
        path = _dir(root, point, own.get("", "")) if fs == "cgroup2" and "" in own else None
        try:
            with open(f"{path}/cgroup.subtree_control") as f:
                delegated = set(f.read().split())
        except OSError:
            continue
        if {"memory", "pids"} <= delegated and os.access(path, os.W_OK):
            return (("v2", path),)
    return ()


def _limit_files(kind: str, memory: int, pids: int) -> list[tuple[str, int, bool]]:
    """(file, value, required) to write in a new cgroup of this kind; swap is capped where
    the kernel accounts it, so swap cannot extend the memory total."""
    return {"memory": [("memory.limit_in_bytes", memory, True),
                       ("memory.memsw.limit_in_bytes", memory, False)],
            "pids": [("pids.max", pids, True)],
            "v2": [("memory.max", memory, True), ("memory.swap.max", 0, False),
                   ("pids.max", pids, True)]}[kind]


def _sweep(base: str) -> None:
    """Remove per-call cgroups whose maker died (a reward pool kills a worker mid-call)."""
    for name in os.listdir(base):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        try:
            os.kill(int(pid), 0)
            continue  # its maker lives, and removes it itself
        except ProcessLookupError:
            pass
        except (PermissionError, ValueError):  # another user's pid, or not our name
            continue
        try:
            os.rmdir(os.path.join(base, name))
        except OSError:  # still holds processes: the next sweep takes it
            pass


class CallCgroup:
    """The cgroups (one per hierarchy) of one call: made before it starts, removed after."""

    def __init__(self, memory_mb: float, processes: int):
        self.dirs: list[str] = []
        name = f"{PREFIX}{os.getpid()}-{next(_calls)}"
        try:
            for kind, base in cgroup_bases():
                _sweep(base)
                path = os.path.join(base, name)
                os.mkdir(path)
                self.dirs.append(path)
                # pid 1 is in the cgroup too: one process more than the program's
                for file, value, required in _limit_files(kind, int(memory_mb * MIB),
                                                          processes + 1):
                    if required or os.path.exists(os.path.join(path, file)):
                        with open(os.path.join(path, file), "w") as f:
                            f.write(str(value))
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files pid 1 writes itself into."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def remove(self) -> None:
        """rmdir each; a cgroup whose last processes are still exiting gets a moment, then is
        left to the next call's sweep."""
        for path in self.dirs:
            for _ in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = []
