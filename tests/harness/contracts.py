"""Artifacts against the TypedDicts that declare them: a key a stage writes and its type does not
name, or a required key it leaves out, is a mismatch. Nested TypedDicts (also inside lists,
mappings and optionals; of a union of several, the one the value fits best) are checked in
turn; other values are not (their types are the code's).

A module that declares such types must not use `from __future__ import annotations`: Python
3.11 cannot see `NotRequired` in a string annotation and counts every key required
(tests/test_contracts.py holds the source tree to that)."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, is_typeddict


def _typeddicts(hint: Any) -> list[Any]:
    """The TypedDicts a field's type may hold a value of: itself, or inside an optional."""
    if is_typeddict(hint):
        return [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [h for a in typing.get_args(hint) for h in _typeddicts(a)]
    return []


def _check_value(value: Any, hint: Any, where: str) -> list[str]:
    """Mismatches of a field's value: a TypedDict's keys, or those of each item of a list or
    mapping of them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.NotRequired or origin is typing.Required:
        return _check_value(value, args[0], where)
    if value is None:
        return []
    kinds = _typeddicts(hint)
    if kinds and isinstance(value, dict):  # of a union, the member it fits best
        return min((mismatches(value, kind, where) for kind in kinds), key=len)
    if origin in (list, tuple) and isinstance(value, list) and args:
        return [m for i, v in enumerate(value) for m in _check_value(v, args[0], f"{where}[{i}]")]
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return [m for k, v in value.items() for m in _check_value(v, args[1], f"{where}.{k}")]
    return []


def mismatches(artifact: dict[str, Any], declared: Any, where: str = "") -> list[str]:
    """Every key of `artifact` its TypedDict `declared` does not name, every required key it
    lacks, recursively; empty when the artifact is what its type says."""
    hints = typing.get_type_hints(declared, include_extras=True)
    found = [
        f"{where}.{k}: written, not in {declared.__name__}"
        for k in sorted(set(artifact) - set(hints))
    ]
    found += [f"{where}.{k}: in {declared.__name__}, not written" for k in sorted(declared.__required_keys__ - set(artifact))]  # fmt: skip
    for key in sorted(set(artifact) & set(hints)):
        found += _check_value(artifact[key], hints[key], f"{where}.{key}")
    return found


def run_mismatches(run: Path) -> list[str]:
    """Every artifact of a finished run (results/<name>/) against the type its writer declares."""
    from stagetrain.consolidate.manifest import Manifest
    from stagetrain.corpus.meta import TokenizerMeta
    from stagetrain.grpo.summary import GrpoSummary
    from stagetrain.hardware.report import HardwareReport
    from stagetrain.planning.plan import PlanPart, PlanRecord, VocabPart
    from stagetrain.pretrain.summary import PretrainSummary
    from stagetrain.training.deepspeed_config import DeepSpeedJson
    from stagetrain.training.spec import GrpoJob, PretrainJob

    files: dict[str, Any] = {
        "hardware.json": HardwareReport,
        "plan.json": PlanRecord,
        "plan/vocab.json": VocabPart,
        "plan/pretrain.json": PlanPart,
        "plan/grpo.json": PlanPart,
        "data/meta.json": TokenizerMeta,
        "deepspeed/pretrain.json": DeepSpeedJson,
        "deepspeed/grpo.json": DeepSpeedJson,
        "pretrain/summary.json": PretrainSummary,
        "grpo/summary.json": GrpoSummary,
        "model/pretrain/MANIFEST.json": Manifest,
        "model/grpo/MANIFEST.json": Manifest,
        "checkpoints/pretrain/job.json": PretrainJob,
        "checkpoints/grpo/job.json": GrpoJob,
    }
    return [
        f"{name}{found}"
        for name, declared in files.items()
        for found in mismatches(json.loads((run / name).read_text()), declared)
    ]
