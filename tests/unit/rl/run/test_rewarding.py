"""Reward terms run in worker processes: a reward that raises, hangs, returns NaN or a string is
counted and gets the fallback; the others are unaffected; the run goes on."""

import sys

import pytest

from rl.config import ConfigError
from rl.run.rewarding import RewardScorer, check_reward_terms
from rl.schema import RewardConfig, RewardTerm

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
    # 3 s per call: the unit tests share the cores with the suite's early runs (tests/early.py),
    # and at 1 s a healthy call timed out once in five suites; "hang" sleeps 60 s either way
    s = scorer([RewardTerm(name=f"{plugin}:flaky"), RewardTerm(name="exact_answer", weight=2.0)],
               fallback=-1.0, timeout_s=3.0)
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


def test_an_environments_own_reward_is_its_samples_total(plugin):
    s = scorer([RewardTerm(name=f"{plugin}:async_len")])
    try:
        totals, m = s.score([{"prompt": "p", "answer": "1"}] * 2, ["a", "bb"], [None, 0.25])
        assert totals == [1.0, 0.25]  # the term's mean still reports what the term scored
        assert m["reward/async_len/mean"] == pytest.approx(1.5)
    finally:
        s.close()


def test_unknown_reward_fails_at_start_with_known_names():
    with pytest.raises(ValueError, match="reward 'mathh' is not registered; known: "):
        scorer([RewardTerm(name="mathh")])


def test_duplicate_aliases_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        scorer([RewardTerm(name="exact_answer"), RewardTerm(name="exact_answer")])


CODE_ROWS = [{"prompt": "p", "tests": [{"fn": "solve", "args": [1], "expect": 1}]},
             {"prompt": "q", "tests": [{"stdin": "1\n", "stdout": "1\n"}]}]


def code_exec_terms(**args):
    return RewardConfig(functions=[RewardTerm(name="exact_answer"),
                                   RewardTerm(name="code_exec", args=args)])


@pytest.mark.parametrize("rows, args, message", [
    (CODE_ROWS + [{"prompt": "r", "tests": ["assert solve(1) == 1"]}], {},
     r"row 2: tests\[0\] is the string 'assert solve\(1\) == 1'; assert strings are not run"),
    (CODE_ROWS + [{"prompt": "r", "tests": [{"fn": "solve", "args": [1]}]}], {},
     r"row 2: tests\[0\] has the keys \['args', 'fn'\]; a function case has fn, args, expect"),
    (CODE_ROWS + [{"prompt": "r"}], {}, r"row 2 has no field 'tests' \(fields: prompt\)"),
    (CODE_ROWS, {"timout_s": 3}, r"code_exec args \['timout_s'\] are unknown; allowed: timeout_s"),
    (CODE_ROWS, {"memory_mb": 0}, r"code_exec memory_mb=0: must be a number > 0"),
    (CODE_ROWS, {"unsafe_no_isolation": "yes"}, r"code_exec unsafe_no_isolation='yes': give true"),
    (CODE_ROWS, {"python": "python3"}, r"code_exec python='python3' is not an executable absolute"),
    # A row's fields reach the reward beside the term's args: a row must not set them.
    (CODE_ROWS + [{**CODE_ROWS[0], "timeout_s": 600}], {},
     r"row 2 has the field 'timeout_s', which is a code_exec arg; set it in the reward term's"),
    (CODE_ROWS + [{**CODE_ROWS[0], "unsafe_no_isolation": True}], {},
     r"row 2 has the field 'unsafe_no_isolation', which is a code_exec arg"),
])
def test_code_exec_rows_and_args_are_checked_at_start(rows, args, message):
    with pytest.raises(ConfigError, match="^reward 'code_exec': " + message) as e:
        check_reward_terms(code_exec_terms(**args), rows)
    assert "\n" not in str(e.value)


def test_code_exec_says_which_python_runs_the_programs(namespaces, capsys):
    import platform

    from rewards.sandbox import interpreter

    here = interpreter(sys.executable)  # the one running this test: its version is known
    assert here.version == platform.python_version()
    check_reward_terms(code_exec_terms(python=sys.executable), CODE_ROWS)
    assert (f"code_exec: programs run on {here.path} (Python {here.version}), isolated"
            in capsys.readouterr().out)


def test_code_exec_refuses_to_start_without_isolation_unless_opted_out(namespaces, monkeypatch,
                                                                      capsys):
    import rewards.builtin
    import rewards.sandbox as sandbox

    check_reward_terms(code_exec_terms(), CODE_ROWS)  # isolation works here
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_isolation_ok", set())
    monkeypatch.setattr(rewards.builtin, "_warned_unsafe", False)
    with pytest.raises(ConfigError, match="^reward 'code_exec': code_exec cannot isolate programs "
                       "on this machine: util-linux setpriv and unshare not found on PATH.*"
                       "unsafe_no_isolation: true"):
        check_reward_terms(code_exec_terms(), CODE_ROWS)
    check_reward_terms(code_exec_terms(unsafe_no_isolation=True), CODE_ROWS)
    assert "WITHOUT ISOLATION" in capsys.readouterr().err
