"""What a config error says: the key, where its value came from (the recipe or an override,
list items as [i]), what was wrong, and what the schema allows there."""
from __future__ import annotations

import dataclasses
import re

from rl.schema import Config


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message says the fix."""


def _known_keys(node) -> str:
    from omegaconf import OmegaConf

    try:
        return ", ".join(OmegaConf.to_container(node, resolve=False).keys())
    except Exception:  # a leaf, not a section: nothing to list
        return ""


def _unset_section_keys(parent: str) -> str:
    """The fields of an optional section that is None by default (trainer.lora), from its
    dataclass."""
    import typing

    kind = Config
    for part in parent.split("."):
        hints = typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}
        if part not in hints:
            return ""
        kind = next((a for a in typing.get_args(hints[part]) if dataclasses.is_dataclass(a)),
                    hints[part])
    return ", ".join(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(
        kind) else ""


def _field_types(key: str) -> tuple:
    """The types a Union field of the schema takes (trainer.gradient_checkpointing: bool, str);
    () for any other field."""
    import typing

    kind = Config
    for part in key.split("."):
        hints = typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}
        if part not in hints:
            return ()
        kind = hints[part]
    args = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else ()
    return tuple(a for a in args if a is not type(None) and not dataclasses.is_dataclass(a))


def _set_at(layer, key: str, prefix: str = "") -> str | None:
    """The dotted path (list items as [i]) where a layer (a recipe or the overrides) sets `key`,
    searched depth first; None when it does not."""
    if isinstance(layer, dict):
        items = layer.items()
    elif isinstance(layer, list):
        items = ((f"[{i}]", v) for i, v in enumerate(layer))
    else:
        return None
    for name, value in items:
        path = f"{prefix}{name}" if str(name).startswith("[") or not prefix else f"{prefix}.{name}"
        if name == key:
            return path
        found = _set_at(value, key, path)
        if found:
            return found
    return None


def explain(e, schema, path: str | None, overrides=(), layers=()) -> str:
    """One line: the key, where it was set, what was wrong, and what is allowed there."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, ConfigKeyError) and "." not in key and dataclasses.is_dataclass(
            getattr(e, "object_type", None)) and e.object_type is not Config:
        # an item of a list of sections (reward.functions[0]) reports its key alone: find
        # where a layer set it, overrides first (they merge last)
        for layer in reversed(layers):
            found = _set_at(OmegaConf.to_container(layer, resolve=False), key)
            if found:
                key = found
                break
    given = _override_of(key, overrides)
    where = f" (in the override {given})" if given else f" (in {path})" if path else ""
    first = str(e).splitlines()[0]
    if isinstance(e, ConfigKeyError):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        kind = getattr(e, "object_type", None)
        if dataclasses.is_dataclass(kind) and kind is not Config:  # the section the key is in
            known = ", ".join(f.name for f in dataclasses.fields(kind))
        else:
            section = OmegaConf.select(schema, parent) if parent else schema
            known = _known_keys(section) if section is not None else _unset_section_keys(parent)
        return (f"config key '{key}'{where} is not known: {first}; known keys"
                f"{' in ' + parent if parent else ''}: {known}")
    default = OmegaConf.select(schema, key, default=None)
    kinds = _field_types(key) or (type(default),)
    hint = f"; give a {' or '.join(k.__name__ for k in kinds)} like the default {default!r}" \
        if isinstance(default, (int, float, str, bool)) else ""
    return f"config key '{key}'{where} has a wrong value: {first}{hint}"


def _override_of(key: str, overrides) -> str | None:
    """The last override that sets `key`, itself or a section or list that holds it."""
    plain = re.sub(r"\[\d+\]", "", key)  # reward.functions[0].weight: set with the list
    for item in reversed(list(overrides)):
        name = item.split("=", 1)[0].strip()
        if name in (key, plain) or plain.startswith(name + "."):
            return item
    return None


def source_of(key: str, path: str | None, recipe, overrides) -> str:
    """Where a key's value came from: the last override that sets it, else the recipe file."""
    from omegaconf import OmegaConf

    given = _override_of(key, overrides)
    if given:
        return f"from the override {given}"
    if recipe is not None and OmegaConf.select(recipe, key, default=None) is not None:
        return f"from {path}"
    return "the default"
