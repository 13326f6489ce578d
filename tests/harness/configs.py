"""Named tiny configs (tests/configs/<name>.yaml): overlays on the default config, loaded by name.

A named config is a partial config file: the sections and keys it changes. They
apply in the order named, nested mappings merged key by key, so that
`named_config("tiny", "tiny-ranks")` is the default config shrunk, then made
fp32 for the multi-rank runs. Tests that run Snakemake write the same overlays
into their workflow copy's config file (`apply_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import ModelSettings

from .workflow import default_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def merge(into: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`into` with `new` merged in place: mappings key by key, any other value replaced."""
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def overlay(name: str) -> dict[str, Any]:
    """The sections tests/configs/<name>.yaml changes."""
    path = CONFIGS / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
        raise ValueError(f"{path}: no such named test config (known: {known})")
    return yaml.safe_load(path.read_text())


def named_config(*names: str, **sections: Mapping[str, Any]) -> dict[str, Any]:
    """The default config with the named overlays applied in order (validated, defaults filled),
    then `sections` (section -> the keys to change, nested mappings merged).

    The overrides are not validated: a test may set a model shape key to None, which a config
    file would leave out (a model continued with `init_from`) and the schema has no null for.
    """
    cfg = default_config()
    for name in names:
        merge(cfg, overlay(name))
    cfg = stconfig.validate(cfg, source=f"tests/configs/{'+'.join(names)}")
    return merge(cfg, sections)


def apply_config(path: Path, *names: str, **sections: Mapping[str, Any]) -> None:
    """Rewrite the config file `path` (of a workflow copy) with the named overlays, then `sections`."""
    data = yaml.safe_load(path.read_text()) or {}
    for change in [*map(overlay, names), sections]:
        merge(data, change)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def edit_config(
    workdir: Path, section: str, *, file: str = "config/config.yaml", **changes: Any
) -> None:
    """Change keys of one section of a config file of the workdir (nested keys as mappings)."""
    apply_config(workdir / file, **{section: changes})


def small_run(workdir: Path, steps: int = 12, *, file: str = "config/config.yaml") -> None:
    """Shrink a config file of the workdir (the default one unless `file` says) to tiny.yaml with
    `steps` pretraining steps, so that the training stages take seconds."""
    apply_config(workdir / file, "tiny", pretrain={"steps": steps})


def small_grpo(workdir: Path, *, file: str = "config/config.yaml") -> None:
    """Shrink the GRPO stage of a config file of the workdir to tiny-grpo.yaml."""
    apply_config(workdir / file, "tiny-grpo")


def model_settings(section: Mapping[str, Any]) -> ModelSettings:
    """A `model` section as the stages get it: keys set to None left out (as a file leaves
    them), validated with its defaults filled, typed."""
    given = {
        k: v for k, v in section.items() if v is not None or k in ("init_from", "architecture")
    }
    return ModelSettings.from_config(stconfig.validate_section("model", given), "model")
