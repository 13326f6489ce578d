"""Loading and validating the run config against workflow/schemas/config.schema.yaml.

The schema is the single reference for every key: its type, bounds, default and
description. The Snakefile validates the whole config with
`snakemake.utils.validate`; stage scripts run on their own validate with
`validate` here, which uses the same schema and fills the same defaults, so a
stage never sees a key the schema does not know or misses a default.

What the plain tools get wrong, and why this module exists:
- PyYAML keeps the last of two equal keys and drops the first without a word;
  `load_yaml` rejects duplicate keys with the file and line.
- jsonschema reports errors as multi-line dumps; `validate` turns the most
  relevant one into one line naming the dotted key and what was expected.
- JSON Schema counts 512.0 as an integer, which later crashes the stages that
  count with it; here `integer` means a whole number written without a point.
- jsonschema matches `pattern` with re.search, where `$` also matches before a
  final newline ("tiny\n" passes '^[a-z]+$'); here a pattern must match the
  whole string.
- The schema cannot say that the families the corpus, the curriculum and replay
  name must be task families (built-in, or of the `tasks` section); `validate`
  checks them, so a typo fails before the run starts.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema import Draft202012Validator, validators

from stagetrain.config.settings import Settings
from stagetrain.errors import StageError

# One schema file: workflow/schemas/config.schema.yaml, which Snakemake validates against;
# the package's schemas/config.schema.yaml is a symbolic link to it, which a wheel stores
# as a copy, so an installed (not editable) stagetrain validates with the same schema.
SCHEMA_PATH = Path(str(resources.files("stagetrain") / "schemas" / "config.schema.yaml"))
SECTIONS = (
    "run", "model", "tokenizer", "data", "tasks", "hardware",
    "parallelism", "deepspeed", "pretrain", "grpo", "tracking", "consolidate", "evaluate",
    "publish",
)  # fmt: skip


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        # `<<: *anchor`: its keys yield to the explicit ones
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            raise StageError(
                f"{key_node.start_mark.name}:{key_node.start_mark.line + 1}: duplicate key "
                f"{key!r} (first at line {seen[key] + 1}); YAML would silently keep only one"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node)


_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # a class, chosen on import


class _FastStrictLoader(_SafeLoader):
    """_StrictLoader on libyaml's parser, where PyYAML has it: the schema parses in 10 ms instead
    of 70, and every Snakemake command and stage script reads it."""


for _loader in (_StrictLoader, _FastStrictLoader):
    _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, failing with one line on a missing file, bad syntax or a duplicate key."""
    try:
        try:
            with open(path, encoding="utf-8") as handle:
                return yaml.load(handle, Loader=_FastStrictLoader)  # noqa: S506 - SafeLoader's kin
        except yaml.YAMLError:  # parsed again for PyYAML's own wording of the problem
            with open(path, encoding="utf-8") as handle:
                return yaml.load(handle, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise StageError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise StageError(f"{path}: is a folder, not a file") from None
    except OSError as err:
        raise StageError(f"{path}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise StageError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise StageError(f"{path}{where}: invalid YAML ({problem})") from None


@cache
def schema() -> dict[str, Any]:
    """The config schema, parsed once per process."""
    return load_yaml(SCHEMA_PATH)


def _is_whole_number(checker: Any, instance: Any) -> bool:
    """`integer` as the stages need it: an int, not a float that happens to be whole."""
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_finite_number(checker: Any, instance: Any) -> bool:
    """`number` as the stages need it: finite. JSON Schema's bounds are comparisons, which NaN
    passes all of (`.nan` as a temperature sampled nothing but one token, to rc 0)."""
    return (
        isinstance(instance, int | float)
        and not isinstance(instance, bool)
        and math.isfinite(instance)
    )


def _full_match(validator, pattern, instance, schema):  # noqa: ANN001, ANN202
    """`pattern` matched against the whole string (re.fullmatch), not searched in it."""
    if validator.is_type(instance, "string") and re.fullmatch(pattern, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _strict(validator_class: type[Any]) -> type:
    """Extend a validator class: defaults filled, whole-number integers, finite numbers,
    whole-string patterns.

    The defaults are filled by `properties` as snakemake.utils.validate does it,
    with two differences: defaults are deep-copied (a shared `{}` default would
    otherwise be mutated by every later fill), and non-objects are left to the
    type check instead of crashing on `setdefault`.
    """
    check_properties = validator_class.VALIDATORS["properties"]

    def fill_defaults(validator, properties, instance, subschema):  # noqa: ANN001
        if validator.is_type(instance, "object"):
            for key, prop in properties.items():
                if "default" in prop and key not in instance:
                    instance[key] = copy.deepcopy(prop["default"])
        yield from check_properties(validator, properties, instance, subschema)

    return validators.extend(
        validator_class,
        {"properties": fill_defaults, "pattern": _full_match},
        type_checker=validator_class.TYPE_CHECKER.redefine_many(
            {"integer": _is_whole_number, "number": _is_finite_number}
        ),
    )


_StrictValidator = _strict(Draft202012Validator)


def _describe(error: jsonschema.ValidationError) -> str:
    """One line for a schema error: the dotted key, what was expected, what was given."""
    path = ".".join(str(part) for part in error.absolute_path) or "<top level>"
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed), key=str)  # YAML keys may be numbers
        where = f"{path}." if error.absolute_path else ""
        return f"{where}{extra[0]}: unknown key (allowed here: {', '.join(allowed) or 'none'})"
    if kind == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        where = f"{path}." if error.absolute_path else ""
        return f"{where}{missing[0]}: required key missing"
    if kind == "type":
        kinds = error.validator_value
        expected = " or ".join(kinds) if isinstance(kinds, list) else kinds
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            expected = f"a finite {expected}"
        return f"{path}: expected {expected}, got {error.instance!r}"
    if kind == "enum":
        options = ", ".join(repr(v) for v in error.validator_value)
        return f"{path}: expected one of {options}, got {error.instance!r}"
    if kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
        return (
            f"{path}: expected a value {sign[kind]} {error.validator_value}, got {error.instance!r}"
        )
    if kind == "maxLength":
        return f"{path}: expected at most {error.validator_value} characters, got {len(error.instance)}"
    if kind == "pattern":
        return f"{path}: expected a string matching {error.validator_value}, got {error.instance!r}"
    return f"{path}: {error.message}"


def validate(config: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Return a validated deep copy of `config` with every default filled in: the schema,
    and what each section's settings check of themselves. The checks across sections run at
    the workflow's door (`workflow.checks`), on the whole config.

    Raises:
        StageError: one line naming the first offending dotted key.
    """
    return _checked(config, source)[0]


def settings(config: Mapping[str, Any], source: str = "config") -> Settings:
    """The whole config validated as `validate` does, as its typed settings."""
    return _checked(config, source)[1]


def _checked(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any], Settings]:
    """The filled copy and its settings: the schema first, then the settings built."""
    _refuse_replaced_keys(config, source)
    filled = copy.deepcopy(dict(config))
    validator = _StrictValidator(schema())
    best = jsonschema.exceptions.best_match(validator.iter_errors(filled))
    if best is not None:
        raise StageError(f"{source}: {_describe(best)}")
    try:
        built = Settings.from_config(filled)
    except StageError as err:
        raise StageError(f"{source}: {err}") from None
    return filled, built


def _refuse_replaced_keys(config: Mapping[str, Any], source: str) -> None:
    """Keys of earlier versions that moved: one line saying where to, not 'unknown key'."""
    generated = (
        (config.get("data") or {}).get("generated")
        if isinstance(config.get("data"), Mapping)
        else None
    )
    if isinstance(generated, Mapping) and "task_files" in generated:
        raise StageError(
            f"{source}: data.generated.task_files: replaced by tasks.families (one entry per family: "
            "{name, files: [...]}), which GRPO reads too; list the family in data.generated.families for the corpus"
        )


def validate_section(name: str, section: Any) -> dict[str, Any]:
    """Validate one section (what a rule passes in `params`) and fill its defaults."""
    if name not in SECTIONS:
        raise StageError(
            f"config: unknown section {name!r} (expected one of {', '.join(SECTIONS)})"
        )
    return validate({name: section})[name]


def read_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a config file, strictly parsed, not yet validated.

    Raises:
        StageError: one line naming the file: missing, a folder, unreadable, bad
            YAML (with the line), a duplicate key, empty, or not a mapping.
    """
    raw = load_yaml(path)
    if raw is None:
        raise StageError(f"{path}: empty config file; expected a mapping of config sections")
    if not isinstance(raw, dict):
        raise StageError(f"{path}: expected a mapping of config sections, got {type(raw).__name__}")
    return raw


def load(path: str | Path) -> dict[str, Any]:
    """Load, strictly parse and validate a config file."""
    return validate(read_file(path), source=str(path))
