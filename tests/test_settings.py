"""The typed config sections (stagetrain.config.settings) against the schema they stand for."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import pytest
from harness.workflow import default_config

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import GrpoSettings, PretrainSettings, Settings, training_settings
from stagetrain.errors import StageError


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    """A schema node with its `$ref` (only ever to #/$defs/...) followed."""
    if "$ref" in node:
        return stconfig.schema()["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds, itself or as the items of a tuple; None for a plain value."""
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    if isinstance(hint, types.UnionType):  # an optional section `X | None`, or plain values
        sections = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return sections[0] if sections else None
    return hint if dataclasses.is_dataclass(hint) else None


def _is_section(node: dict[str, Any]) -> bool:
    """Whether a schema node holds keys of its own (an object, or an array of objects)."""
    node = _resolve(node)
    if node.get("type") == "array":
        node = _resolve(node["items"])
    return "properties" in node


def _mismatches(cls: type, node: dict[str, Any], where: str) -> list[str]:
    """Every key in one of (dataclass fields, schema properties) and not the other, recursively."""
    node = _resolve(node)
    if node.get("type") == "array":
        node = _resolve(node["items"])
    keys = set(node.get("properties", {}))
    fields = {f.name for f in dataclasses.fields(cls)}
    found = [f"{where}.{k}: in the schema, not in {cls.__name__}" for k in sorted(keys - fields)]
    found += [f"{where}.{k}: in {cls.__name__}, not in the schema" for k in sorted(fields - keys)]
    hints = typing.get_type_hints(cls)
    for name in sorted(fields & keys):
        child, subschema = _section_type(hints[name]), node["properties"][name]
        if child is not None:
            found += _mismatches(child, subschema, f"{where}.{name}")
        elif _is_section(subschema):
            found.append(
                f"{where}.{name}: a section in the schema, a plain value in {cls.__name__}"
            )
        else:
            found += _choice_mismatch(hints[name], subschema, f"{where}.{name}")
    return found


def _literals(hint: Any) -> set[Any]:
    """The values a `Literal` allows, inside an optional or a tuple too; empty for other types."""
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    return set().union(*map(_literals, typing.get_args(hint)))


def _choice_mismatch(hint: Any, node: dict[str, Any], where: str) -> list[str]:
    """A schema enum and the field's Literal name the same values (None aside: the optional)."""
    node = _resolve(node)
    if node.get("type") == "array":
        node = _resolve(node["items"])
    enum, literal = set(node.get("enum", ())) - {None}, _literals(hint)
    return [] if enum == literal else [f"{where}: the schema allows {enum}, the type {literal}"]


def test_every_dataclass_has_exactly_the_schemas_keys() -> None:
    assert _mismatches(Settings, stconfig.schema(), "config") == []


def test_a_key_added_to_the_schema_alone_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a new nested key (in a $ref'd section) is reported."""
    schema = stconfig.schema()
    optimizer = {
        **schema["$defs"]["optimizer"],
        "properties": {
            **schema["$defs"]["optimizer"]["properties"],
            "nesterov": {"type": "boolean"},
        },
    }
    monkeypatch.setitem(schema["$defs"], "optimizer", optimizer)
    found = _mismatches(Settings, schema, "config")
    assert "config.pretrain.optimizer.nesterov: in the schema, not in OptimizerSettings" in found
    assert "config.grpo.optimizer.nesterov: in the schema, not in OptimizerSettings" in found


def test_a_value_added_to_a_schema_enum_alone_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each enum is a Literal with the same values: a loss type added to the schema only is found."""
    schema = stconfig.schema()
    grpo = schema["properties"]["grpo"]
    loss = {**grpo["properties"]["loss_type"], "enum": ["grpo", "dapo", "dr_grpo", "gspo"]}
    monkeypatch.setitem(grpo, "properties", {**grpo["properties"], "loss_type": loss})
    found = _mismatches(Settings, schema, "config")
    assert [f for f in found if f.startswith("config.grpo.loss_type: ")] == found != []


def test_the_default_config_builds_with_lists_as_tuples() -> None:
    cfg = default_config()
    settings = Settings.from_config(cfg)
    assert settings.pretrain.seq_len == cfg["pretrain"]["seq_len"]
    assert settings.pretrain.optimizer.betas == tuple(cfg["pretrain"]["optimizer"]["betas"])
    assert settings.grpo.curriculum.families == tuple(cfg["grpo"]["curriculum"]["families"])
    assert settings.model.init_from is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.grpo.steps = 1  # type: ignore[misc]


def test_derived_values_are_computed_in_one_place() -> None:
    cfg = default_config()
    settings = training_settings("grpo", {**cfg["grpo"], "steps": 7, "passes": 3})
    assert isinstance(settings, GrpoSettings) and settings.optimizer_steps == 21
    pretrain = training_settings("pretrain", {**cfg["pretrain"], "steps": 7})
    assert isinstance(pretrain, PretrainSettings) and pretrain.optimizer_steps == 7


def test_a_section_that_skipped_validation_is_one_line() -> None:
    grpo = dict(default_config()["grpo"])
    del grpo["passes"]
    with pytest.raises(StageError, match=r"^config: grpo\.passes: required key missing"):
        training_settings("grpo", grpo)
    with pytest.raises(StageError, match=r"^config: grpo\.tree\.depth: unknown key"):
        training_settings("grpo", {**default_config()["grpo"], "tree": {"depth": 2}})
