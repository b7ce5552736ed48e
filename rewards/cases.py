"""code_exec test cases: their form, what of them the sandbox may see, and the verdicts.

A case is data in the dataset row's `tests`:
    {"fn": "solve", "args": [1, 2], "expect": 3}        fn(*args) returns expect; optional "tol"
    {"stdin": "1 2\\n", "stdout": "3\\n"}                the program as a script prints stdout
Verdicts are made here, in the trusted parent, from the answers the sandbox wrote: only the
program's return values or output ever come back, and expected values never go in.
"""
from __future__ import annotations

import json
import math

DEFAULT_TOL = 1e-6  # relative tolerance of float comparisons (absolute when expect is 0)
FORM = ('{"fn": "solve", "args": [1, 2], "expect": 3} (optional "tol": 1e-6) or '
        '{"stdin": "1 2\\n", "stdout": "3\\n"}')
FN_KEYS, IO_KEYS = {"fn", "args", "expect"}, {"stdin", "stdout"}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def case_problem(case) -> str | None:
    """What is wrong with one case, or None when it has one of the two forms."""
    if isinstance(case, str):
        return f"is the string {_short(case)}; assert strings are not run any more"
    if not isinstance(case, dict):
        return f"is a {type(case).__name__} ({_short(case)}), not an object"
    keys = set(case)
    if "fn" in keys:
        if not FN_KEYS <= keys or keys - FN_KEYS - {"tol"}:
            return f"has the keys {sorted(keys)}; a function case has fn, args, expect (and tol)"
        if not isinstance(case["fn"], str) or not case["fn"].isidentifier():
            return f"names the function {_short(case['fn'])}; fn must be a Python name"
        if not isinstance(case["args"], list):
            return f"has args {_short(case['args'])}; args must be a list"
        tol = case.get("tol", DEFAULT_TOL)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            return f"has tol {_short(tol)}; tol must be a number >= 0"
        try:
            json.dumps([case["args"], case["expect"]], allow_nan=False)
        except (TypeError, ValueError):
            return "has args or expect that JSON cannot hold (sets, NaN, objects)"
        return None
    if keys & IO_KEYS:
        if keys != IO_KEYS or not all(isinstance(case[k], str) for k in IO_KEYS):
            return (f"has {_short(case)}; a stdin case has exactly stdin and stdout, "
                    f"both strings")
        return None
    return f"has the keys {sorted(keys)}, neither form"


def check_tests(tests, where: str) -> None:
    """Raise one line naming `where` (e.g. 'row 3') when `tests` is not a list of cases."""
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{where}: code_exec tests must be a non-empty list of cases, got "
                         f"{_short(tests)}; each case is {FORM}")
    for k, case in enumerate(tests):
        problem = case_problem(case)
        if problem:
            raise ValueError(f"{where}: tests[{k}] {problem}; each case is {FORM}")


def public(case: dict) -> dict:
    """What the sandbox gets of a case: the question, never the expected answer."""
    if "fn" in case:
        return {"fn": case["fn"], "args": case["args"]}
    return {"stdin": case["stdin"]}


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def read_answers(raw: bytes, cases: list[dict]) -> dict[int, dict]:
    """The first well-formed answer line per case index; every other line is ignored."""
    found: dict[int, dict] = {}
    for line in raw.split(b"\n"):
        try:
            record = json.loads(line, parse_constant=_no_constants)
        except (ValueError, RecursionError):  # malformed, cut off, or nested too deep
            continue
        if not isinstance(record, dict):
            continue
        i = record.get("i")
        if type(i) is not int or not 0 <= i < len(cases) or i in found:
            continue
        kind = "value" if "fn" in cases[i] else "stdout"
        if set(record) == {"i", "error"} or (set(record) == {"i", kind} and (
                kind == "value" or isinstance(record["stdout"], str))):
            found[i] = record
    return found


def same_value(got, want, tol: float = DEFAULT_TOL) -> bool:
    """JSON equality: bools only equal bools, ints exactly, floats (or an int against a float)
    within tol relative (absolute when want is 0); lists and dicts element by element."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is bool and type(want) is bool and got == want
    if isinstance(want, (int, float)):
        if not isinstance(got, (int, float)):
            return False
        if isinstance(want, int) and isinstance(got, int):
            return got == want
        try:
            return math.isclose(got, want, rel_tol=tol, abs_tol=tol if want == 0 else 0.0)
        except OverflowError:  # an int too large for a float is no float's equal
            return False
    if isinstance(want, str) or want is None:
        return type(got) is type(want) and got == want
    if isinstance(want, (list, tuple)):  # a tuple arrives as a list
        return (isinstance(got, list) and len(got) == len(want)
                and all(same_value(g, w, tol) for g, w in zip(got, want)))
    if isinstance(want, dict):
        return (isinstance(got, dict) and set(got) == set(want)
                and all(same_value(got[k], want[k], tol) for k in want))
    return False


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_stdout(got: str, want: str) -> bool:
    """Line by line, trailing whitespace stripped, trailing empty lines dropped."""
    return _lines(got) == _lines(want)


def verdicts(cases: list[dict], answers: dict[int, dict]) -> list[bool]:
    """One pass/fail per case of the parent's list: a case with no answer fails."""
    out = []
    for i, case in enumerate(cases):
        record = answers.get(i)
        if record is None or "error" in record:
            out.append(False)
        elif "fn" in case:
            out.append(same_value(record["value"], case["expect"], case.get("tol", DEFAULT_TOL)))
        else:
            out.append(same_stdout(record["stdout"], case["stdout"]))
    return out
