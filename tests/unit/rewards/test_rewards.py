"""Reward lookup and the built-in exact-answer reward."""
import pytest

from rewards.builtin import exact_answer, last_number
from rewards.registry import resolve


@pytest.mark.parametrize("text, value", [("42", 42.0), ("it is -7.", -7.0), ("1,234 then 5", 5.0),
                                         ("total 1,234", 1234.0), ("no digits", None)])
def test_last_number(text, value):
    assert last_number(text) == value


@pytest.mark.parametrize("completion, answer, reward", [
    ("25", "25", 1.0), ("The answer is 25.", "25", 1.0), ("25.0", "25", 1.0), ("-8", "-8", 1.0),
    ("8", "-8", 0.0), ("24", "25", 0.0), ("", "25", 0.0)])
def test_exact_answer(completion, answer, reward):
    assert exact_answer(prompt="q", completion=completion, answer=answer) == reward


def test_resolve_builtin_and_module_function():
    assert resolve("exact_answer") is exact_answer
    assert resolve("rewards.builtin:exact_answer") is exact_answer


def test_resolve_errors_say_the_fix():
    with pytest.raises(ValueError, match="reward 'mathh' is not registered; known: exact_answer"):
        resolve("mathh")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve("no_such_mod:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve("rewards.builtin:nope")
