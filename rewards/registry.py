"""Finding reward functions: a built-in name, an installed entry point, `module:function`, or
`path/to/file.py:function`.

A per-sample reward is `fn(prompt: str, completion: str, **row) -> float` where `row` holds the
dataset row's other fields (e.g. `answer`) and the term's `args`. A batched reward, marked with
`@batched`, is `fn(prompts: list[str], completions: list[str], **columns) -> list[float]` where
each column is a list over the batch. Either may be `async def`.
Installed packages register rewards under the entry-point group `rlstack.rewards`.
A reward may carry a start check (`@start_check`) that rl/ runs once, on all dataset rows,
before anything else starts.
"""
from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from rewards.api import (  # noqa: F401
    REWARDS,
    StartCheckError,
    batched,
    is_batched,
    register,
    start_check,
    start_check_of,
)

ENTRY_POINT_GROUP = "rlstack.rewards"


def _entry_points(group: str) -> dict:
    return {ep.name: ep for ep in entry_points(group=group)}


def known_in(table: dict, group: str) -> list[str]:
    """The names of `table`'s built-ins and of the entry points of `group`."""
    return sorted(set(table) | set(_entry_points(group)))


def find(spec: str, table: dict, group: str, kind: str, what: str = "function"):
    """What `spec` names: a built-in of `table`, an entry point of `group`, `module:name` or
    `path/to/file.py:name` (envs/ finds its environments through this too); `kind` and `what`
    word the errors."""
    if spec in table:
        return table[spec]
    eps = _entry_points(group)
    if spec in eps:
        obj = eps[spec].load()
        if not callable(obj):
            raise ValueError(f"{kind} '{spec}': entry point {eps[spec].value} is not callable")
        return obj
    if ":" in spec:
        return from_spec(spec, kind)
    raise ValueError(f"{kind} '{spec}' is not registered; known: "
                     f"{', '.join(known_in(table, group))} (or give module:{what} or "
                     f"path/to/file.py:{what})")


def known_names() -> list[str]:
    import rewards.builtin  # noqa: F401  (registers the built-ins)

    return known_in(REWARDS, ENTRY_POINT_GROUP)


def from_file(spec: str, kind: str = "reward") -> Callable:
    """The attribute `path/to/file.py:name` names (a function, or a class); `kind` names what
    is looked for in errors (envs/ loads its environments through this too)."""
    path, _, attr = spec.rpartition(":")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{kind} '{spec}': file '{file}' does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_{kind}_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} '{spec}': '{file}' has no function or class '{attr}'")
    return fn


def from_module(spec: str, kind: str = "reward") -> Callable:
    """The attribute `module:name` names, importing the module."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} '{spec}': cannot import module '{module_name}' ({e}); "
                         f"is it installed or on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} '{spec}': module '{module_name}' has no function or class "
                         f"'{attr}'")
    return fn


def from_spec(spec: str, kind: str = "reward") -> Callable:
    """`path/to/file.py:name` or `module:name`."""
    return (from_file(spec, kind) if spec.rpartition(":")[0].endswith(".py")
            else from_module(spec, kind))


def resolve(spec: str) -> Callable:
    """The reward function that `spec` names (see the module docstring for the forms)."""
    import rewards.builtin  # noqa: F401  (registers the built-ins)

    return find(spec, REWARDS, ENTRY_POINT_GROUP, "reward")
