"""exact_answer, for the resume tests: holds the step in which the test kills a process.

Each hold file `$RL_TEST_HOLD_FILE.<n>` holds a condition, 'CHECKPOINT LINES'. A call made while
such a file exists, once the run's checkpoints/latest names CHECKPOINT and its metrics.jsonl has
at least LINES lines, touches `<hold file>.held` and waits until the hold file is gone. The test
knows then which step the driver is in: the first step after LINES logged lines. Several hold
files let one run be held (and a process killed) more than once."""
import glob
import os
import time
from pathlib import Path

from rewards.builtin import exact_answer as _exact_answer


def _due(run: Path, at: str, lines: int) -> bool:
    latest, metrics = run / "checkpoints" / "latest", run / "metrics.jsonl"
    return (latest.exists() and latest.read_text() == at and metrics.exists()
            and metrics.read_text().count("\n") >= lines)


def exact_answer(prompt: str, completion: str, answer: str, **row) -> float:
    prefix = os.environ.get("RL_TEST_HOLD_FILE")
    for hold in sorted(glob.glob(f"{prefix}.*")) if prefix else []:
        if hold.endswith(".held"):
            continue
        try:
            at, lines = Path(hold).read_text().split()
        except (FileNotFoundError, ValueError):  # released, or being written
            continue
        if _due(Path(os.environ["RL_TEST_HOLD_RUN"]), at, int(lines)):
            Path(hold + ".held").touch()
            while os.path.exists(hold):
                time.sleep(0.05)
    return _exact_answer(prompt, completion, answer)
