"""Progress a person can follow: bars on a terminal, plain lines in a log file.

On a terminal (stdout is a TTY) the warm-up, the RL steps and long saves get tqdm bars (the
steps' bar shows the reward and the ETA) and each step's detail line scrolls above the bar.
Anywhere else (a pipe, `ray job logs`, CI) there are no bars: one plain line per step, a warm-up
line every 50 steps, a line when a save starts and ends.
"""
from __future__ import annotations

import sys
import time


def interactive(stream=None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """A bar over `total` units when interactive, else `every`-th-unit lines."""

    def __init__(self, total: int, desc: str, unit: str = "step", stream=None, every: int = 1):
        self.stream = stream or sys.stdout
        self.desc, self.total, self.every = desc, total, every
        self.bar = None
        if interactive(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                            dynamic_ncols=True, leave=True)

    def update(self, done: int, line: str, postfix: dict | None = None) -> None:
        """Unit `done` (1-based) finished; `line` is its detail, `postfix` the bar's summary."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(done - self.bar.n)
        elif done % self.every == 0 or done == self.total:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def wait_with_progress(futures: list, desc: str, stream=None) -> list:
    """ray.get(futures), showing the elapsed time while they run (a save of a large model)."""
    import ray

    stream = stream or sys.stdout
    start = time.perf_counter()
    if not interactive(stream):
        print(f"{desc}...", file=stream, flush=True)
        out = ray.get(futures)
        print(f"{desc}: done in {time.perf_counter() - start:.1f} s", file=stream, flush=True)
        return out
    from tqdm import tqdm

    with tqdm(total=len(futures), desc=desc, unit="rank", file=stream, leave=False) as bar:
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            bar.update(len(done))
            bar.refresh()
    return ray.get(futures)
