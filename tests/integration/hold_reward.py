"""exact_answer, for the resume test: while the file $RL_TEST_HOLD_FILE exists, calls are counted
and every call from number $RL_TEST_HOLD_AFTER on waits until the file is gone, so the test
knows which step the driver is in when it kills it."""
import fcntl
import os
import time

from rewards.builtin import exact_answer as _exact_answer


def exact_answer(prompt: str, completion: str, answer: str, **row) -> float:
    hold = os.environ.get("RL_TEST_HOLD_FILE")
    if hold and os.path.exists(hold):
        with open(hold + ".count", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            calls = len(f.read())
            f.write("x")
        if calls >= int(os.environ["RL_TEST_HOLD_AFTER"]):
            while os.path.exists(hold):
                time.sleep(0.05)
    return _exact_answer(prompt, completion, answer)
