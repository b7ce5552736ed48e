"""A reward that raises or returns garbage is counted and gets the fallback; the run goes on."""
import math

from rl.config import RewardConfig
from rl.rewarding import RewardScorer

CALLS = []


def flaky(prompt, completion, answer, **row):
    CALLS.append(completion)
    if completion == "raise":
        raise RuntimeError("boom")
    return {"nan": math.nan, "str": "1.0", "bool": True}.get(completion, 1.0)


def test_bad_samples_are_counted_and_get_the_fallback(capsys):
    scorer = RewardScorer(RewardConfig(name=f"{__name__}:flaky", fallback=-1.0), "prompt")
    rows = [{"prompt": "p", "answer": "1"}] * 5
    rewards, m = scorer.score(rows, ["ok", "raise", "nan", "str", "bool"])
    assert rewards == [1.0, -1.0, -1.0, -1.0, -1.0]
    assert m["reward/errors"] == 4.0
    assert m["reward/mean"] == (1.0 - 4.0) / 5
    out = capsys.readouterr().out
    assert out.count("Traceback") == 1 and "boom" in out  # the first traceback, once


def test_row_fields_reach_the_reward():
    scorer = RewardScorer(RewardConfig(name="exact_answer"), "prompt")
    rewards, _ = scorer.score([{"prompt": "What is 1 + 1?", "answer": "2"}], ["2"])
    assert rewards == [1.0]
