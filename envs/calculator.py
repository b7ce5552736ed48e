"""The `calculator` tool: arithmetic on numbers, evaluated from the syntax tree (no `eval`).

Allowed: int and float literals, + - * / // % ** (exponent at most MAX_EXPONENT in size),
unary + -, parentheses. Every error is a one-line message for the model, never an exception.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 300  # an expression longer than this is refused unparsed
MAX_EXPONENT = 64
MAX_DIGITS = 60  # an int result with more digits is refused (a model can ask 9**9**9)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalculatorError(ValueError):
    """What the model wrote cannot be computed; the message is the answer it gets."""


def _check(value):
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if isinstance(value, int) and abs(value) >= 10 ** MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents above {MAX_EXPONENT} are not computed")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("^ is not a power here; write ** (2**10)")
    raise CalculatorError(f"'{ast.unparse(node)}' is not arithmetic; use {ALLOWED}")


def evaluate(expression: str) -> int | float:
    """The value of `expression`; raises CalculatorError with the reason."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"'{expression}' does not parse; use {ALLOWED}") from None
    return _eval(tree)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, e.g. "37 * 482" or "(2.5 + 3) / 4".
    """
    try:
        value = evaluate(expression)
    except CalculatorError as e:
        return f"error: {e}"
    if isinstance(value, float):  # 15 significant digits: 0.1 + 0.2 reads 0.3, 2**-64 stays
        return repr(float(format(value, ".15g")))
    return str(value)
