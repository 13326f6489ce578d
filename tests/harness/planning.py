"""Plans without a detect_hardware run: a described CPU machine, the presets, and the planner
called as the stage calls it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagetrain import config as stconfig
from stagetrain.hardware.detect import describe
from stagetrain.planning.resolve import resolve

from .workflow import REPO

GIB = 2**30


def plan_for(cfg: Mapping[str, Any], hardware: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """plan.json for `cfg` on `hardware` (default: the machine `cfg`'s hardware section describes)."""
    hardware = hardware or describe(cfg["hardware"])
    return resolve(
        hardware=hardware, hw_config=cfg["hardware"], model=cfg["model"], tokenizer=cfg["tokenizer"],
        parallelism=cfg["parallelism"], deepspeed=cfg["deepspeed"], pretrain=cfg["pretrain"], grpo=cfg["grpo"],
    )  # fmt: skip


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
