"""Finding environments: a built-in name, an installed entry point (group `rlstack.envs`),
`module:Class`, or `path/to/file.py:Class`."""
from __future__ import annotations

import functools

from envs.api import ENVS, Env
from envs.config import EnvConfig
from rewards.registry import find, known_in

ENTRY_POINT_GROUP = "rlstack.envs"


def _builtins() -> None:
    import envs.openai_agent  # noqa: F401  (registers the built-ins)
    import envs.tools  # noqa: F401


def known_names() -> list[str]:
    _builtins()
    return known_in(ENVS, ENTRY_POINT_GROUP)


def resolve(spec: str) -> type[Env]:
    """The environment class `spec` names; it must subclass envs.api.Env (or have its
    reset/step)."""
    _builtins()
    cls = find(spec, ENVS, ENTRY_POINT_GROUP, "env", what="Class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"env '{spec}' is not an environment class (missing "
                         f"{', '.join(missing) or 'a class'}); subclass envs.api.Env")
    return cls


def env_factory(cfg: EnvConfig):
    """A callable making the run's environment (one per trajectory), or None (single-turn)."""
    if cfg.name is None:
        return None
    return functools.partial(resolve(cfg.name), **cfg.env_args())
