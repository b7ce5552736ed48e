"""The reward pool's timeout kills the worker mid-call: a code_exec sandbox running there must
go with it, its detached processes included, and the call's cgroups must not pile up."""
import os
import threading
import time

from rewards.pool import ERROR, OK, TIMEOUT, RewardPool
from rewards.sandbox_limits import PREFIX, cgroup_bases

BLOCKER = """```python
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "97.541"])
    os._exit(0)
time.sleep(60)
def solve(x):
    return x
```"""


def cgroups_of(pid: int) -> list[str]:
    """The per-call cgroups a process made that are still there."""
    return [name for _, base in cgroup_bases() for name in os.listdir(base)
            if name.startswith(f"{PREFIX}{pid}-")]


def test_a_pool_timeout_leaves_nothing_running_or_behind(namespaces, leftovers):
    tests = [{"fn": "solve", "args": [1], "expect": 1}]
    warm = (0, {"prompt": "p", "completion": "def solve(x):\n    return x\n", "tests": tests})
    # 60 s for the warm calls (a new worker's first one probes isolation in a sandbox of its
    # own, then runs one: seconds on a loaded machine), 4 s for the blocker, which waits it out
    pool = RewardPool(["code_exec"], num_workers=1, timeout_s=60.0)
    try:
        assert pool.run([warm]) == [(OK, 1.0)]  # the worker is up and has probed isolation
        killed = pool.workers[0].process.pid
        seen, stop = [], threading.Event()

        def watch():  # proof the sleeper did start, so its absence afterwards means something
            while not stop.is_set() and not seen:
                seen.extend(leftovers.pids_with(["97.541"]))
                stop.wait(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        # the sandbox's own limit (30 s) is far past the pool's (4 s): the pool's kill acts
        pool.timeout_s = 4.0
        result = pool.run([(0, {"prompt": "p", "completion": BLOCKER, "tests": tests,
                                "timeout_s": 30.0})])
        pool.timeout_s = 60.0
        stop.set()
        watcher.join()
        assert result == [(TIMEOUT, None)]
        assert seen, "the sandboxed program never started its sleeper"
        assert leftovers(["97.541"]) == []
        if cgroup_bases():
            # The killed worker could not remove its call's cgroups: the next call sweeps them.
            assert cgroups_of(killed), "the killed call made no cgroup"
            assert pool.run([warm]) == [(OK, 1.0)]
            assert cgroups_of(killed) == []
    finally:
        pool.close()


CHUNKED = '''
import os, time

def slow(prompt, completion):
    if completion == "hang":
        time.sleep(60)
    if completion == "die":
        os._exit(3)
    time.sleep(float(completion))
    return float(completion)
'''


def test_chunked_calls_keep_a_timeout_per_call_and_the_calls_after_a_dead_one(tmp_path):
    """40 calls on 2 workers go in chunks of 5: a chunk of 0.21 s calls outlasts the 1 s timeout
    as a whole (sleeps never end early), yet no call times out; a hang and a crash in the middle
    of a chunk cost only their own call, and the rest of that chunk is answered by a new
    worker."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(CHUNKED)
    completions = ["0.21"] * 40
    completions[7], completions[22] = "hang", "die"
    pool = RewardPool([f"{plugin}:slow"], num_workers=2, timeout_s=1.0)
    try:
        results = pool.run([(0, {"prompt": "p", "completion": c}) for c in completions])
    finally:
        pool.close()
    assert results[7] == (TIMEOUT, None)
    assert results[22][0] == "error" and "exit code 3" in results[22][1]
    assert [r for i, r in enumerate(results) if i not in (7, 22)] == [(OK, 0.21)] * 38


def test_an_answer_that_came_during_another_workers_replacement_is_not_a_timeout(tmp_path,
                                                                                 monkeypatch):
    """One pass over the workers: the first one's call killed it, and replacing it (kill, join,
    spawn) took long enough, on a loaded machine, for the second's answer to arrive and its
    deadline to pass. The answer is there: it is the call's result, not a timeout."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(CHUNKED)
    pool = RewardPool([f"{plugin}:slow"], num_workers=2, timeout_s=1.0)
    replace = pool._replace

    def slow_replace(w):  # the replacement outlasts the other worker's answer and deadline
        other = next(x for x in pool.workers if x is not w)
        assert other.conn.poll(10), "the other worker never answered"
        time.sleep(max(0.0, other.deadline - time.monotonic()) + 0.05)
        replace(w)
    try:
        assert pool.run([(0, {"prompt": "p", "completion": "0"})] * 2) == [(OK, 0.0)] * 2
        monkeypatch.setattr(pool, "_replace", slow_replace)
        results = pool.run([(0, {"prompt": "p", "completion": c}) for c in ("die", "0.3")])
    finally:
        pool.close()
    assert results[0][0] == ERROR and "exit code 3" in results[0][1]
    assert results[1] == (OK, 0.3)


SLOW_IMPORT = '''
import time

time.sleep(1.0)  # the reward's imports: each worker's start-up


def slow(prompt, completion):
    if completion == "hang":
        time.sleep(60)
    return 1.0
'''


def test_a_workers_start_up_is_not_its_calls_time(tmp_path):
    """A call's timeout runs from when its worker is ready: a reward that takes 1 s to import
    answers under a 0.8 s timeout (room for a loaded machine's round trip), the first call and the
    one after a hang (which a new worker, starting again, answers). Timed from the call's sending,
    both came back timeouts (under the suite's load a 1 s reward.timeout_s ran out on a
    replacement's start-up)."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(SLOW_IMPORT)
    pool = RewardPool([f"{plugin}:slow"], num_workers=1, timeout_s=0.8)
    try:
        results = pool.run([(0, {"prompt": "p", "completion": c}) for c in ("a", "hang", "b")])
    finally:
        pool.close()
    assert results == [(OK, 1.0), (TIMEOUT, None), (OK, 1.0)]
