"""Reward lookup: a registered name or `module:function`.

A reward is a callable `fn(prompt: str, completion: str, **row) -> float`, where `row` holds the
dataset row's other fields (e.g. `answer`). Built-ins register themselves with `@register`.
"""
from __future__ import annotations

import importlib
from typing import Callable

REWARDS: dict[str, Callable[..., float]] = {}


def register(name: str):
    def wrap(fn):
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is registered twice; pick another name")
        REWARDS[name] = fn
        return fn
    return wrap


def resolve(name: str) -> Callable[..., float]:
    """The reward function for a registered name or a `module:function` path."""
    import rewards.builtin  # noqa: F401  (registers the built-ins)

    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"reward '{name}': cannot import module '{module_name}' ({e}); "
                             f"is it installed or on PYTHONPATH?") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"reward '{name}': module '{module_name}' has no function '{attr}'")
        return fn
    raise ValueError(f"reward '{name}' is not registered; known: {', '.join(sorted(REWARDS))} "
                     f"(or give module:function)")
