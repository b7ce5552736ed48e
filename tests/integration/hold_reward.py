"""exact_answer, for the resume tests: holds the step in which the test kills a process.

While the file $RL_TEST_HOLD_FILE exists, a call made once the run's checkpoints/latest names
$RL_TEST_HOLD_AT and its metrics.jsonl has at least $RL_TEST_HOLD_LINES lines touches
$RL_TEST_HOLD_FILE.held and waits until the hold file is gone. The test knows then which step
the driver is in: the first step after that many logged lines."""
import os
import time
from pathlib import Path

from rewards.builtin import exact_answer as _exact_answer


def _due(run: Path) -> bool:
    latest, metrics = run / "checkpoints" / "latest", run / "metrics.jsonl"
    return (latest.exists() and latest.read_text() == os.environ["RL_TEST_HOLD_AT"]
            and metrics.exists()
            and metrics.read_text().count("\n") >= int(os.environ["RL_TEST_HOLD_LINES"]))


def exact_answer(prompt: str, completion: str, answer: str, **row) -> float:
    hold = os.environ.get("RL_TEST_HOLD_FILE")
    if hold and os.path.exists(hold) and _due(Path(os.environ["RL_TEST_HOLD_RUN"])):
        Path(hold + ".held").touch()
        while os.path.exists(hold):
            time.sleep(0.05)
    return _exact_answer(prompt, completion, answer)
