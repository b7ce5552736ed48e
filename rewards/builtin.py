"""Built-in rewards."""
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
