"""code_exec's cases: their form, what the sandbox sees of them, and verdicts made outside it."""
import pytest

from rewards.cases import check_tests, public, read_answers, same_stdout, same_value, verdicts


@pytest.mark.parametrize("got, want, equal", [
    (3, 3, True), (3, 4, False), (3.0, 3, True), (3, 3.0, True),
    (1.0000001, 1.0, True),            # relative 1e-7 < 1e-6
    (1.00001, 1.0, False),             # relative 1e-5
    (1e-7, 0, True), (1e-5, 0.0, False),  # against 0 the tolerance is absolute
    (True, 1, False), (1, True, False), (True, True, True), (0, False, False),
    ("1", 1, False), (None, None, True), (None, 0, False), ([], None, False),
    ([1, [2, 3]], (1, (2, 3)), True),  # a tuple arrives as a list
    ([1, 2], [1, 2, 3], False), ({"a": 1}, {"a": 1.0}, True), ({"a": 1}, {"a": 1, "b": 2}, False),
    ({"a": True}, {"a": 1}, False), (10 ** 400, 1.5, False),
])
def test_same_value(got, want, equal):
    assert same_value(got, want) is equal


def test_same_value_with_tol():
    assert same_value(1.05, 1.0, tol=0.1) and not same_value(1.05, 1.0, tol=0.01)


@pytest.mark.parametrize("got, want, equal", [
    ("3\n", "3", True), ("3  \r\n\n\n", "3\n", True), ("a\nb\n", "a \nb", True),
    ("3\n", "4\n", False), ("\n3\n", "3\n", False), ("3 4\n", "3  4\n", False)])
def test_same_stdout(got, want, equal):
    assert same_stdout(got, want) is equal


CASES = [{"fn": "f", "args": [1], "expect": 1}, {"stdin": "x", "stdout": "y\n"}]


def test_only_the_first_well_formed_answer_per_case_counts():
    raw = b"\n".join([
        b"garbage", b'{"i": 0, "value": NaN}', b'{"i": true, "value": 1}',
        b'{"i": 0.0, "value": 1}', b'{"i": 5, "value": 1}', b'{"i": 0, "value": 1, "passed": true}',
        b'{"i": 1, "value": "y"}',
        b'{"i": 0, "value": 2}', b'{"i": 0, "value": 1}', b'{"i": 1, "stdout": "y"}',
        b'{"i": 1, "stdout": "no"}', b'{"i": 1, "stdout": 3', b"\xff\xfe"])
    answers = read_answers(raw, CASES)
    assert answers == {0: {"i": 0, "value": 2}, 1: {"i": 1, "stdout": "y"}}
    assert verdicts(CASES, answers) == [False, True]


def test_a_case_without_an_answer_or_with_an_error_fails():
    assert verdicts(CASES, {}) == [False, False]
    assert verdicts(CASES, read_answers(b'{"i": 0, "error": "x"}\n{"i": 1, "error": "y"}', CASES)) \
        == [False, False]


def test_the_sandbox_never_sees_expected_values():
    assert [public(c) for c in CASES] == [{"fn": "f", "args": [1]}, {"stdin": "x"}]


@pytest.mark.parametrize("tests, message", [
    ([], "must be a non-empty list"),
    ("assert f(1) == 1", "must be a non-empty list"),
    (["assert f(1) == 1"], r"tests\[0\] is the string 'assert f\(1\) == 1'; assert strings are"),
    ([{"fn": "f", "args": 1, "expect": 1}], "args must be a list"),
    ([{"fn": "f(1)", "args": [], "expect": 1}], "fn must be a Python name"),
    ([{"fn": "f", "args": []}], "a function case has fn, args, expect"),
    ([{"fn": "f", "args": [], "expect": 1, "tol": -1}], "tol must be a number >= 0"),
    ([{"fn": "f", "args": [], "expect": float("nan")}], "JSON cannot hold"),
    ([{"stdin": "1"}], "exactly stdin and stdout"),
    ([{"stdin": 1, "stdout": "1"}], "both strings"),
    ([{"input": "1", "output": "1"}], "neither form"),
    ([7], "is a int"),
])
def test_malformed_tests_name_the_row_and_the_form(tests, message):
    with pytest.raises(ValueError, match=message) as e:
        check_tests(tests, "row 3")
    assert str(e.value).startswith("row 3: ") and "\n" not in str(e.value)
    assert '{"fn": "solve", "args": [1, 2], "expect": 3}' in str(e.value)
