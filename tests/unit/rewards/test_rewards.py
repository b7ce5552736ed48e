"""Reward lookup in every form, and the built-in rewards."""
import subprocess
import sys
import textwrap

import pytest

from rewards.builtin import (code_exec, exact_answer, format_reward, last_number, length_reward,
                             math_answer)
from rewards.registry import ENTRY_POINT_GROUP, is_batched, resolve


@pytest.mark.parametrize("text, value", [("42", 42.0), ("it is -7.", -7.0), ("1,234 then 5", 5.0),
                                         ("total 1,234", 1234.0), ("no digits", None)])
def test_last_number(text, value):
    assert last_number(text) == value


@pytest.mark.parametrize("completion, answer, reward", [
    ("25", "25", 1.0), ("The answer is 25.", "25", 1.0), ("25.0", "25", 1.0), ("-8", "-8", 1.0),
    ("8", "-8", 0.0), ("24", "25", 0.0), ("", "25", 0.0)])
def test_exact_answer(completion, answer, reward):
    assert exact_answer(prompt="q", completion=completion, answer=answer) == reward


@pytest.mark.parametrize("completion, answer", [
    (r"so the result is \boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    ("work...\n#### 1,000", "1000"),
    ("The total is 12,345.", "12345"),
    (r"\boxed{\dfrac{3}{4}}", "3/4"),
    (r"\boxed{1.50}", "3/2"),
    ("#### 42", "42"),
    (r"\boxed{50\%}", "0.5"),
    ("<think>add</think> <answer>41/24</answer>", "41/24"),
    ("<think>x</think> <answer>1.25</answer>", "5/4"),
])
def test_math_equivalent(completion, answer):
    assert math_answer(prompt="q", completion=completion, answer=answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    (r"\boxed{\frac{1}{3}}", "0.5"),
    ("#### 1,001", "1000"),
    (r"\boxed{2}", "3"),
    ("no answer here", "7"),
    (r"\boxed{\sqrt{2}}", "2"),
    ("<think>5/4</think> <answer>5/3</answer>", "5/4"),
])
def test_math_not_equivalent(completion, answer):
    assert math_answer(prompt="q", completion=completion, answer=answer) == 0.0


def test_format_and_length():
    good = "<think>add them</think> <answer>5</answer>"
    assert format_reward(prompt="q", completion=good) == 1.0
    assert format_reward(prompt="q", completion="<answer>5</answer>") == 0.0
    assert format_reward(prompt="q", completion=good, pattern=".*", tags=["answer"]) == 1.0
    assert format_reward(prompt="q", completion="x", pattern=".*", tags=["answer"]) == 0.0
    # budget 10, buffer 4: free up to 6 chars, then linear to -1 at 10 and beyond
    assert length_reward(prompt="q", completion="x" * 6, budget=10, buffer=4) == 0.0
    assert length_reward(prompt="q", completion="x" * 8, budget=10, buffer=4) == -0.5
    assert length_reward(prompt="q", completion="x" * 30, budget=10, buffer=4) == -1.0


def test_code_exec_fraction_of_tests(namespaces):
    completion = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    tests = [{"fn": "add", "args": [1, 2], "expect": 3}, {"fn": "add", "args": [2, 2], "expect": 5},
             {"fn": "add", "args": [0, 0], "expect": 0}]
    assert code_exec(prompt="q", completion=completion, tests=tests) == pytest.approx(2 / 3)


def test_code_exec_refuses_assert_strings():
    with pytest.raises(ValueError, match="assert strings are not run any more"):
        code_exec(prompt="q", completion="def f(): return 1", tests=["assert f() == 1"])


def test_code_exec_opt_out_warns_once_and_still_judges_outside(capsys):
    import rewards.builtin

    rewards.builtin._warned_unsafe = False
    tests = [{"fn": "f", "args": [], "expect": 1}]
    for code, reward in (("def f(): return 1", 1.0), ("def f(): return True", 0.0)):
        assert code_exec(prompt="q", completion=code, tests=tests,
                         unsafe_no_isolation=True) == reward
    assert capsys.readouterr().err.count("WITHOUT ISOLATION") == 1


def test_resolve_builtin_module_and_file(tmp_path):
    assert resolve("exact_answer") is exact_answer
    assert resolve("rewards.builtin:exact_answer") is exact_answer
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def shout(prompt, completion, **row):\n    return float(completion.isupper())\n")
    fn = resolve(f"{plugin}:shout")
    assert fn(prompt="p", completion="YES") == 1.0 and not is_batched(fn)


def test_resolve_entry_point_of_an_installed_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "rewardplug").mkdir(parents=True)
    (pkg / "rewardplug" / "__init__.py").write_text(
        "def brevity(prompt, completion, **row):\n    return 1.0 / (1 + len(completion))\n")
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "rewardplug"
        version = "0.1"
        [project.entry-points."{ENTRY_POINT_GROUP}"]
        brevity = "rewardplug:brevity"
    """))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(pkg)], check=True)
    code = ("from rewards.registry import resolve, known_names; "
            "assert 'brevity' in known_names(); "
            "print(resolve('brevity')(prompt='p', completion='abc'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.25"


def test_resolve_errors_say_the_fix(tmp_path):
    with pytest.raises(ValueError, match="reward 'mathh' is not registered; known: .*math"):
        resolve("mathh")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve("no_such_mod:f")
    with pytest.raises(ValueError, match="has no function or class 'nope'"):
        resolve("rewards.builtin:nope")
    with pytest.raises(ValueError, match="does not exist"):
        resolve(f"{tmp_path}/missing.py:f")


@pytest.mark.parametrize("completion, reward", [
    ('{"count": 12}', 1.0), ('{"count": "12"}', 1.0), ('{"count": 11}', 0.0),
    ('{"other": 12}', 0.0), ("12", 0.0), ("{not json", 0.0), ('[12]', 0.0)])
def test_json_field(completion, reward):
    from rewards.builtin import json_field

    assert json_field(prompt="q", completion=completion, answer="12", field="count") == reward
