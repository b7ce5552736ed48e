"""Bit-exact resume: a run whose driver is SIGKILLed and resumed with --resume, or whose trainer
actor is SIGKILLed and restarted from its latest checkpoint, logs every step exactly as the run
that was never interrupted (fp32, CPU, colocated ZeRO-3 + vLLM), every key but timings; and its
logs hold each step once. The test is one uninterrupted run, one run hurt twice, and one resume:
rl-train's start-up is most of its time, so the three are CLI processes driven from a process of
their own, started with the integration tests (tests/early.py): start-ups and waits, which leave
cores idle beside the other tests."""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from rl.config import load_config
from tests.early import early
from tests.integration.recipe_checks import check_step_metrics
from tests.procs import processes, with_descendants

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
# PPO (a critic: its weights and optimizer, GAE; the reference model) with DAPO's dynamic
# sampling (several rollout rounds per step: the data position moves by more than a batch), 6
# steps, a checkpoint every 2, every logger; one tensor-parallel engine over both workers (its
# ranks restarted with the placement and restored by a checked sync, as TP 1 engines are).
ARGS = ["recipes/ppo.yaml", "rollout.tensor_parallel_size=2",
        "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
        "trainer.total_steps=6", "trainer.checkpoint_every=2", "warmup.sft_steps=4",
        "rollout.prompts_per_step=8", "trainer.micro_batch_size=8", "reward.timeout_s=300",
        "run.loggers=[jsonl,tensorboard,wandb]",
        "reward.functions=[{name: tests/integration/hold_reward.py:exact_answer}]"]


def timing(key: str) -> bool:
    """Keys a rerun may change: times, memory, the plan (from this machine's measured speed),
    and checkpoint sizes (the saved config and state name the run, and the two runs here have
    different names)."""
    return (key.startswith(("time/", "throughput/", "checkpoint/", "memory/", "plan/"))
            or key.endswith(("seconds", "tokens_per_s")))


def assert_same_steps(want: list[dict], got: list[dict]) -> None:
    assert [m["step"] for m in want] == [m["step"] for m in got]
    for a, b in zip(want, got):
        keys = {k for k in a if not timing(k)}
        assert keys == {k for k in b if not timing(k)}, a["step"]
        differ = {k: (a[k], b[k]) for k in keys if a[k] != b[k]}
        assert not differ, (a["step"], differ)


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rl_train(tmp: Path, name: str, *extra: str, env: dict | None = None, wait: bool = True,
             args: list[str] = ARGS):
    cmd = [sys.executable, "-m", "rl.cli", *args, f"run.output_dir={tmp}", f"run.name={name}",
           *extra]
    env = dict(os.environ, **(env or {}))  # the session's model and warm-up cache
    if not wait:  # a session of its own: a failing test kills the whole run (see `held`)
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every live process below `pid`."""
    procs = processes()
    return {p: procs[p][2] for p in with_descendants({pid}, procs) - {pid}}


HELD: set[int] = set()  # the sessions (process groups) of the runs `held` has started


def kill_held_on_sigterm() -> None:
    """For a process that drives held runs (python -m a test module): a SIGTERM (the test
    session's end, tests/early.py) kills them, whose sessions are their own, and exits."""
    def stop(*_):
        for pid in list(HELD):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)


@contextmanager
def held(tmp: Path, name: str, holds: list[tuple[str, int]], *extra: str, args: list[str] = ARGS):
    """A run started with the hold reward and one hold file per (checkpoint, lines logged) in
    `holds` (see hold_reward.py); yields (process, hold files). The run is killed with its
    session and every hold released however the test ends."""
    files = [tmp / f"hold-{name}.{i}" for i in range(len(holds))]
    for f, (at, lines_logged) in zip(files, holds):
        f.with_name(f.name + "-new").write_text(f"{at} {lines_logged}")
        f.with_name(f.name + "-new").rename(f)  # never read half-written
    proc = rl_train(tmp, name, *extra, wait=False, args=args,
                    env={"RL_TEST_HOLD_FILE": str(tmp / f"hold-{name}"),
                         "RL_TEST_HOLD_RUN": str(tmp / name)})
    HELD.add(proc.pid)
    try:
        yield proc, files
    finally:
        HELD.discard(proc.pid)
        for f in files:
            f.unlink(missing_ok=True)
        try:  # what a killed driver leaves (reward pool, Ray) holds the output pipe open
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_held(proc, hold: Path) -> None:
    """Until the run is held on `hold`: in the first step after its lines were logged."""
    deadline = time.time() + 600
    while not Path(f"{hold}.held").exists():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, f"the run never reached the step {hold.name} holds"
        time.sleep(0.1)


def kill_driver(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # the driver only, as a crash would
    proc.wait()


def hurt_and_resume(tmp: Path) -> None:
    """One run is hurt twice: a trainer actor is SIGKILLed in step 3 (trainer.max_restarts=1
    restarts the placement from step_2), then the driver is SIGKILLed in step 6, having logged
    step 5 past its checkpoint step_4; `--resume` drops that line, writes it again and
    finishes."""
    with held(tmp, "r", [("step_2", 2), ("step_4", 5)], "trainer.max_restarts=1") as (
            proc, (actor_hold, driver_hold)):
        wait_held(proc, actor_hold)
        workers = [pid for pid, args in descendants(proc.pid).items()
                   if "ray::ColocatedWorker" in args]
        assert len(workers) == 2, descendants(proc.pid)
        os.kill(workers[1], signal.SIGKILL)
        actor_hold.unlink()
        wait_held(proc, driver_hold)
        kill_driver(proc)
    out = proc.stdout.read()  # complete once the run's session is gone
    assert "died during step 3" in out and "restarting the placement from step_2" in out, out[-3000:]
    assert [m["step"] for m in lines(tmp / "r")] == [1, 2, 3, 4, 5]
    out = rl_train(tmp, "r", "--resume")
    assert "resuming from" in out.stdout and "step_4" in out.stdout


def runs(tmp: Path) -> None:
    """The uninterrupted run (`whole`, metrics.jsonl only: loggers do not touch the numbers)
    beside the hurt one (`r`): their start-ups overlap."""
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(rl_train, tmp, "whole", "run.loggers=[jsonl]")
        hurt_and_resume(tmp)
        (tmp / "whole.out").write_text(whole.result().stdout)


RUNS = early("resume", __file__, with_integration=True, command=lambda tmp: [
    sys.executable, "-m", "tests.integration.test_resume", str(tmp)])


@pytest.mark.integration
def test_dead_actor_in_step_3_and_killed_driver_in_step_6_resume_bit_exact():
    """The hurt and resumed run's steps 1-6 equal the uninterrupted run's bit for bit (the
    critic's loss and values too), and metrics.jsonl, rollouts.jsonl, TensorBoard and W&B hold
    each step once."""
    RUNS.passed()
    assert "rollout engines: 1 x vLLM at TP 2" in (RUNS.dir / "whole.out").read_text()
    whole = lines(RUNS.dir / "whole")
    assert [m["step"] for m in whole] == [1, 2, 3, 4, 5, 6]
    check_step_metrics(load_config(str(RUNS.dir / "whole" / "config.yaml")), whole)
    assert max(m["dynamic/rounds"] for m in whole) > 1, whole  # it did sample again
    assert all("loss/value" in m and "values/mean" in m for m in whole)
    again = lines(RUNS.dir / "r")
    assert_same_steps(whole, again)  # each step once, bit for bit
    check_logs(RUNS.dir / "r", 6)
    check_loggers(RUNS.dir / "r", again)


def check_logs(run: Path, steps: int) -> None:
    assert (run / "final_model" / "config.json").exists()
    assert not list((run / "checkpoints").glob("*.tmp"))
    logged = [json.loads(x)["step"] for x in (run / "rollouts.jsonl").read_text().splitlines()]
    # run.log_samples = 2 completions per step, each step once
    assert logged == [s for s in range(1, steps + 1) for _ in range(2)], logged


def check_loggers(run: Path, want_lines: list[dict]) -> None:
    """TensorBoard and W&B hold each step once with metrics.jsonl's values: what a SIGKILLed
    process's W&B service never wrote, the resumed run logged from metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl.observe.loggers import wandb_offline_history

    want = [(m["step"], m["reward/mean"]) for m in want_lines]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("reward/mean")] == want
    rows = [(r["_step"], r["reward/mean"]) for r in wandb_offline_history(run)
            if "reward/mean" in r]
    assert rows == want


if __name__ == "__main__":
    kill_held_on_sigterm()
    runs(Path(sys.argv[1]))
