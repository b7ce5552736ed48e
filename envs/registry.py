"""Finding environments: a built-in name, an installed entry point (group `rlstack.envs`),
`module:Class`, or `path/to/file.py:Class`."""
from __future__ import annotations

from importlib.metadata import entry_points

from envs.api import ENVS, Env
from rewards.registry import from_spec

ENTRY_POINT_GROUP = "rlstack.envs"


def _builtins() -> None:
    import envs.tools  # noqa: F401  (registers the built-ins)


def known_names() -> list[str]:
    _builtins()
    return sorted(set(ENVS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def resolve(spec: str) -> type[Env]:
    """The environment class `spec` names; it must subclass envs.api.Env (or have its
    reset/step)."""
    _builtins()
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if spec in ENVS:
        cls = ENVS[spec]
    elif spec in eps:
        cls = eps[spec].load()
    elif ":" in spec:
        cls = from_spec(spec, kind="env")
    else:
        raise ValueError(f"env '{spec}' is not registered; known: {', '.join(known_names())} "
                         f"(or give module:Class or path/to/file.py:Class)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"env '{spec}' is not an environment class (missing "
                         f"{', '.join(missing) or 'a class'}); subclass envs.api.Env")
    return cls
