"""Plans without a detect_hardware run: a described CPU machine, the presets, and the planner
called as the stage calls it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagetrain.config import validation as stconfig
from stagetrain.hardware.detect import describe
from stagetrain.planning.plan import PlanRecord
from stagetrain.planning.resolve import PlannerSettings, resolve

from .workflow import REPO

GIB = 2**30


def plan_for(cfg: Mapping[str, Any], hardware: Mapping[str, Any] | None = None) -> PlanRecord:
    """plan.json for `cfg`, a validated config, on `hardware` (default: the machine `cfg`'s
    hardware section describes; a test's may hold only the keys the planner reads)."""
    settings = PlannerSettings.from_config(cfg)
    return resolve(hardware or describe(settings.hardware), settings)


def cpu_hardware(ranks: int = 2, memory_gib: float = 24, nodes: int = 1) -> dict[str, Any]:
    """hardware.json of `nodes` 2-core CPU nodes running `ranks` ranks each, as detect_hardware writes it."""
    return {
        "gpu": None, "nodes": nodes, "cpu_ranks": ranks, "gpus_per_node": 0,
        "cpu": {"cores": 2, "memory_bytes": int(memory_gib * GIB)},
    }  # fmt: skip


def preset_config(name: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """config/presets/<name>.yaml, validated, with `sections` (section -> keys) changed on top."""
    cfg = stconfig.load(REPO / "config" / "presets" / f"{name}.yaml")
    for section, changes in sections.items():
        cfg[section] = {**cfg[section], **changes}
    return cfg
