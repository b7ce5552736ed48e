"""Time of one code_exec call on a trivial correct program: the cost of the sandbox itself.

    .venv/bin/python benchmarks/sandbox_overhead.py [--runs 50]

Median and p90 over --runs calls through the reward function itself (isolation checked once
before timing), against the 0.3 s target; beside it the same program with
unsafe_no_isolation (a plain process: the floor the namespaces add to).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # this checkout's rewards/, not an install

from rewards.builtin import code_exec  # noqa: E402
from rewards.sandbox import check_isolation  # noqa: E402

TARGET_S = 0.3
COMPLETION = "```python\ndef solve(x):\n    return x\n```"
TESTS = [{"fn": "solve", "args": [1], "expect": 1}]


def timings(runs: int, **args) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        reward = code_exec(prompt="p", completion=COMPLETION, tests=TESTS, **args)
        out.append(time.perf_counter() - start)
        if reward != 1.0:
            raise RuntimeError(f"a correct program scored {reward}; the benchmark is void")
    return out


def summary(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    runs = parser.parse_args().runs
    check_isolation()
    median, p90 = summary(timings(runs))
    print(f"code_exec, trivial correct program, {runs} runs: median {median:.3f} s, "
          f"p90 {p90:.3f} s; target < {TARGET_S} s: median/target = {median / TARGET_S:.2f}")
    plain, _ = summary(timings(runs, unsafe_no_isolation=True))
    print(f"without isolation (unsafe_no_isolation): median {plain:.3f} s; "
          f"isolated/plain = {median / plain:.1f}x")


if __name__ == "__main__":
    main()
