"""Reward terms run in worker processes: a reward that raises, hangs, returns NaN or a string is
counted and gets the fallback; the others are unaffected; the run goes on."""

import pytest

from rl.config import RewardConfig, RewardTerm
from rl.rewarding import RewardScorer

PLUGIN = '''
import asyncio, math, time
from rewards.registry import batched

def flaky(prompt, completion, answer, **row):
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "hang":
        time.sleep(60)
    return {"nan": math.nan, "str": "1.0", "bool": True}.get(completion, 1.0)

async def async_len(prompt, completion, **row):
    await asyncio.sleep(0)
    return float(len(completion))

@batched
def batch_len(prompts, completions, answer, scale=1.0, **columns):
    return [scale * len(c) for c in completions]
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(PLUGIN)
    return path


def scorer(terms, **kw):
    return RewardScorer(RewardConfig(functions=terms, **kw), "prompt")


def test_faults_are_counted_and_the_rest_goes_on(plugin, capsys):
    s = scorer([RewardTerm(name=f"{plugin}:flaky"), RewardTerm(name="exact_answer", weight=2.0)],
               fallback=-1.0, timeout_s=1.0)
    try:
        rows = [{"prompt": "p", "answer": "1"}] * 6
        totals, m = s.score(rows, ["1", "raise", "hang", "nan", "str", "bool"])
        # flaky: 1.0 for "1", fallback -1 for the 5 others; exact_answer: 1 only for "1"
        assert totals == [1.0 + 2.0] + [-1.0] * 5
        assert m["reward/errors"] == 4.0 and m["reward/timeouts"] == 1.0
        assert m["reward/flaky/mean"] == pytest.approx((1 - 5) / 6)
        assert m["reward/exact_answer/mean"] == pytest.approx(1 / 6)
        out = capsys.readouterr().out
        assert out.count("first failure") == 1
        # the pool survived the timeout (its worker was replaced): it still scores
        totals, m = s.score(rows[:2], ["1", "1"])
        assert totals == [3.0, 3.0] and m["reward/errors"] == 0 and m["reward/timeouts"] == 0
    finally:
        s.close()


def test_async_and_batched_rewards_with_args(plugin):
    s = scorer([RewardTerm(name=f"{plugin}:async_len"),
                RewardTerm(name=f"{plugin}:batch_len", weight=0.5, args={"scale": 10.0})],
               batch_size=2)
    try:
        totals, m = s.score([{"prompt": "p", "answer": "1"}] * 3, ["a", "bb", "ccc"])
        assert totals == [1 + 5.0, 2 + 10.0, 3 + 15.0]
        assert m["reward/batch_len/mean"] == pytest.approx(20.0)
    finally:
        s.close()


def test_unknown_reward_fails_at_start_with_known_names():
    with pytest.raises(ValueError, match="reward 'mathh' is not registered; known: "):
        scorer([RewardTerm(name="mathh")])


def test_duplicate_aliases_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        scorer([RewardTerm(name="exact_answer"), RewardTerm(name="exact_answer")])
