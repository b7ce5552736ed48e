"""Every numeric config value has a declared bound, and every value outside it is refused at start:
exit 2, one `rl-train:` line naming the key, the value, the bound and where the value came from,
no traceback, and Ray never imported."""
import dataclasses
import sys
import typing

import pytest
from omegaconf import OmegaConf

import rl.cli
from rl.config import ConfigError, load_config, within
from rl.schema import Config

RECIPE = "recipes/quickstart.yaml"
# tried in order; the first outside a field's bound is the case (ints only for int fields)
CANDIDATES = [-1_000_000_000, -2, -1, -0.5, 0, 0.5, 1, 1.5, 2, 4, 1_000_000_000, float("nan")]


def numeric_fields(cls=Config, prefix=""):
    """(key, type, bound) of every int/float field of the schema, sections and the items of
    lists of sections (as key[0]) included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if dataclasses.is_dataclass(kind):
            yield from numeric_fields(kind, key + ".")
        elif typing.get_origin(kind) is list and args and dataclasses.is_dataclass(args[0]):
            yield from numeric_fields(args[0], key + "[0].")
        elif typing.get_origin(kind) is typing.Union and args and dataclasses.is_dataclass(
                args[0]):  # an optional section (trainer.lora)
            yield from numeric_fields(args[0], key + ".")
        elif kind in (int, float) or (typing.get_origin(kind) is typing.Union
                                      and args and args[0] in (int, float)):
            yield key, (args[0] if args else kind), f.metadata.get("bound")


FIELDS = list(numeric_fields())


def outside(kind, bound):
    return next(v for v in CANDIDATES if (kind is float or isinstance(v, int))
                and not within(v, bound))


def override(key, value):
    """The override that sets key (a list item's field is set with its list)."""
    text = ".nan" if value != value else repr(value)
    if "[0]." in key:
        section, name = key.split("[0].")
        return f"{section}=[{{name: exact_answer, {name}: {text}}}]"
    return f"{key}={text}"


def test_the_schema_has_numeric_fields_and_each_declares_a_bound_its_default_meets():
    assert len(FIELDS) > 60  # the walk reaches every section (rollout, trainer, loss, ...)
    missing = [key for key, _, bound in FIELDS if bound is None]
    assert not missing, f"numeric config fields without metadata={{'bound': ...}}: {missing}"
    defaults = OmegaConf.structured(load_config(None))
    for key, _, bound in FIELDS:
        value = OmegaConf.select(defaults, key)
        assert value is None or within(value, bound), (key, value, bound)


@pytest.mark.parametrize("key, kind, bound", FIELDS, ids=[k for k, _, _ in FIELDS])
def test_a_value_outside_the_bound_exits_2_with_one_line_before_ray(key, kind, bound, capsys,
                                                                    monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray would fail the test
    value = outside(kind, bound)
    item = override(key, value)
    assert rl.cli.main([RECIPE, item]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rl-train: config key '{key}' = ")
    assert f"(from the override {item}) is out of range" in lines[0], lines[0]
    assert bound in lines[0] or bound == "any", lines[0]


def test_the_error_names_the_recipe_file_a_value_came_from(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("trainer:\n  lr: -0.001\n")
    with pytest.raises(ConfigError, match=rf"'trainer.lr' = -0.001 \(from {recipe}\) is out of "
                                          rf"range: give a value > 0"):
        load_config(str(recipe))


@pytest.mark.parametrize("value, bound, ok", [
    (0.0, "> 0", False), (1e-9, "> 0", True), (0, ">= 0", True), (-1, ">= -1", True),
    (1.0, "in (0, 1]", True), (0.0, "in (0, 1]", False), (1.0, "in [0, 1)", False),
    (0.0, "> 1 or 0", True), (1.0, "> 1 or 0", False), (3.0, "> 1 or 0", True),
    (float("nan"), "any", False), (float("inf"), ">= 0", False), (-5.0, "any", True)])
def test_bounds_read_as_written(value, bound, ok):
    assert within(value, bound) is ok
