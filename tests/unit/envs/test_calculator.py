"""The calculator tool: arithmetic computed from the syntax tree, everything else an error
message for the model (never an exception, never `eval`)."""
import pytest

from envs.calculator import calculator


@pytest.mark.parametrize("expression,value", [
    ("37 * 482", "17834"), ("(2.5 + 3) / 4", "1.375"), ("2 ** 10", "1024"), ("7 // 2", "3"),
    ("-3 % 5", "2"), ("6 / 3", "2.0"), ("0.1 + 0.2", "0.3"), ("-(4 - 10)", "6"),
    ("2 ** -2", "0.25"), (" 12*12 ", "144"), ("2 ** -64", "5.42101086242752e-20"),
    ("1 / 3", "0.333333333333333"),
])
def test_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "is not arithmetic"),
    ("(1).__class__", "is not arithmetic"),
    ("[1, 2]", "is not arithmetic"),
    ("x + 1", "is not arithmetic"),
    ("True + 1", "is not arithmetic"),  # bools are not numbers here
    ("2 ^ 10", "write **"),
    ("9 ** 9 ** 9", "exponents above 64"),
    ("10 ** 59 * 10", "more than 60 digits"),
    ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("3 +", "does not parse"),
    ("1+" * 200 + "1", "longer than 300"),
])
def test_anything_else_is_an_error_message(expression, why):
    out = calculator(expression)
    assert out.startswith("error: ") and why in out, out


def test_a_non_string_is_an_error_message():
    assert calculator(12).startswith("error: the expression must be a string")
