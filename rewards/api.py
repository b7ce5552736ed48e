"""What a reward module uses: `@register` (built-ins), `@batched`, `@start_check`.

Imports nothing of the project, so that rewards.builtin and user reward files can use it and
rewards.registry can import the built-ins without a circle. rewards.registry re-exports it.
"""
from __future__ import annotations

from typing import Callable

REWARDS: dict[str, Callable] = {}


def registrar(table: dict, kind: str):
    """A `@register(name)` decorator that puts what it wraps into `table` (envs/ makes its own
    from this); a name registered twice is an error."""
    def register(name: str):
        def wrap(obj):
            if name in table:
                raise ValueError(f"{kind} '{name}' is registered twice; pick another name")
            table[name] = obj
            return obj
        return wrap
    return register


register = registrar(REWARDS, "reward")
"Register a built-in reward under `name`."


def batched(fn):
    """Mark a reward as batched: it takes lists and returns one float per sample."""
    fn.__reward_batched__ = True
    return fn


def is_batched(fn) -> bool:
    return bool(getattr(fn, "__reward_batched__", False))


class StartCheckError(ValueError):
    """A reward's start check refused the run; the message is one line: the row or arg, what
    was given, the fix."""


def start_check(check: Callable[[list, dict], None]):
    """Give a reward `check(rows, args)`, run once at start with every dataset row and the
    term's args, before any sample is scored; it raises ValueError (StartCheckError, or any
    other ValueError with a one-line message) to refuse the run. E.g. code_exec checks each
    row's tests."""
    def wrap(fn):
        fn.__reward_start_check__ = check
        return fn
    return wrap


def start_check_of(fn) -> Callable[[list, dict], None] | None:
    """The start check `fn` carries (see start_check), or None."""
    return getattr(fn, "__reward_start_check__", None)
