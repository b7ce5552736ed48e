"""The machine's processes from /proc, for tests that check what a run left behind or pick one
of its processes to kill."""
import os
from pathlib import Path


def processes() -> dict[int, tuple[int, str, str]]:
    """{pid: (parent pid, state letter, command line)} of every process now."""
    procs = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            args = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if entry.isdigit():
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            procs[int(entry)] = (int(ppid), state, args.strip() or stat.split()[1])
    return procs


def with_descendants(roots: set[int], procs: dict) -> set[int]:
    """`roots` and every process below them in `procs`."""
    below, grown = set(roots), True
    while grown:
        more = {p for p, (ppid, _, _) in procs.items() if ppid in below} - below
        below |= more
        grown = bool(more)
    return below
