"""Built-in rewards: exact_answer, math, json_field, format, length, code_exec."""
from __future__ import annotations

import re

from rewards.registry import register

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last integer/decimal in text (commas between digit groups ignored), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


@register("exact_answer")
def exact_answer(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's last number equals the reference `answer`, else 0.0."""
    got, want = last_number(completion), last_number(str(answer))
    return 1.0 if got is not None and want is not None and abs(got - want) < 1e-9 else 0.0


@register("math")
def math_answer(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's final answer equals `answer` numerically or symbolically.

    The final answer is the last `<answer>...</answer>`, then within it (or the whole text) the
    last `\\boxed{}`, a `#### 42` line, or else the last number/expression; equivalence
    (fractions, decimals, LaTeX, 1,000 = 1000, 50% = 0.5) is decided by HuggingFace's
    `math-verify`.
    """
    from math_verify import parse, verify

    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    text = tagged[-1] if tagged else completion
    marker = re.search(r"####\s*(.+?)\s*$", text, flags=re.MULTILINE)
    if "\\boxed" not in text and marker:
        text = marker.group(1)
    gold = parse(str(answer))
    guess = parse(text)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess) else 0.0


DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@register("json_field")
def json_field(prompt: str, completion: str, answer: str, field: str = "answer", **row) -> float:
    """1.0 when the completion is a JSON object whose `field` equals `answer` (as text or
    number), else 0.0 (also for invalid JSON)."""
    import json

    try:
        value = json.loads(completion)
    except ValueError:
        return 0.0
    if not isinstance(value, dict) or field not in value:
        return 0.0
    got = value[field]
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        want = last_number(str(answer))
        return 1.0 if want is not None and abs(float(got) - want) < 1e-9 else 0.0
    return 1.0 if str(got).strip() == str(answer).strip() else 0.0


@register("format")
def format_reward(prompt: str, completion: str, pattern: str = DEFAULT_FORMAT,
                  tags: list | None = None, **row) -> float:
    """1.0 when the completion matches `pattern` (whole text, DOTALL) and holds every tag in
    `tags` as an open/close pair, else 0.0."""
    if not re.match(pattern, completion, flags=re.DOTALL):
        return 0.0
    for tag in tags or []:
        if f"<{tag}>" not in completion or f"</{tag}>" not in completion:
            return 0.0
    return 1.0


@register("length")
def length_reward(prompt: str, completion: str, budget: int = 512, buffer: int = 128,
                  penalty: float = 1.0, **row) -> float:
    """0 within `budget - buffer` characters, falling linearly to -penalty at `budget` and
    beyond (an overlong penalty on the text's length in characters)."""
    start = budget - buffer
    if len(completion) <= start:
        return 0.0
    return -penalty * min(len(completion) - start, buffer) / max(buffer, 1)


@register("code_exec")
def code_exec(prompt: str, completion: str, tests: list, timeout_s: float = 5.0,
              memory_mb: int = 512, **row) -> float:
    """Fraction of `tests` (Python assert statements) that the completion's code passes, run in
    a sandbox (rewards.sandbox): own process, CPU/memory/file-size/process limits, no network,
    a throw-away directory, a wall timeout."""
    from rewards.sandbox import extract_code, run_tests

    if not tests:
        return 0.0
    passed = run_tests(extract_code(completion), list(tests), timeout_s=timeout_s,
                       memory_mb=memory_mb)
    return passed / len(tests)
