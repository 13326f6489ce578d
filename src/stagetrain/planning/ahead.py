"""The plan worked out while Snakemake builds its DAG, so that a dry run lists what a run runs.

The stages read small parts of the plan (`planning.derived`): the tokenizer stage the tp its
vocabulary pads for; each training stage, its DeepSpeed config and its consolidation their
stage's layout. A replan that leaves a part byte-identical must not rerun its readers, and
`snakemake -n` must say so before anything runs. Snakemake cannot see inside a file that a job
is about to write: a job whose outputs another job reads is taken to change them. So each part
has its own job (rule plan_part), whose rerun trigger is the `digest` of the part it will write,
worked out here before any job runs: the part's job, and so its readers, rerun exactly when the
part's bytes change. plan.json, the whole record, is a job of its own that no stage reads.

The plan is the recorded plan.json when that was planned from the same inputs (`INPUTS_KEY`, a
digest of hardware.json, the config the planner reads, its files and its code: `inputs_key`),
else the planner runs here, in Snakemake's process (imports of torch and transformers, seconds,
then a fraction of one), which happens after an edit the planner reads, until plan.json is
written again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json
from stagetrain.planning.plan import PlanRecord

PLAN_KEYS = {
    "tokenizer": ("vocab_size",),
    "pretrain": ("seq_len", "global_batch_size", "global_batch_unit"),
    "grpo": ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "kl_coef"),
}
"""The keys of the sections the planner reads only in part: editing any other key of these
sections (a learning rate, a curriculum threshold) must not replan."""
PLANNED_SECTIONS = (
    "hardware",
    "model",
    "tokenizer",
    "parallelism",
    "deepspeed",
    "pretrain",
    "grpo",
)

INPUTS_KEY = "inputs_sha256"
"""plan.json's record of the inputs it was planned from (`inputs_key`)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def planner_sections(config: Mapping[str, Any]) -> dict[str, Any]:
    """What the planner reads of the config, as its rule passes it: whole sections, and only
    PLAN_KEYS of the others. Raw config (Snakemake's, not yet validated): `inputs_key` digests
    these exact values, and `plan_ahead` validates and types them."""
    return {
        name: {k: config[name][k] for k in PLAN_KEYS[name]} if name in PLAN_KEYS else config[name]
        for name in PLANNED_SECTIONS
    }


def inputs_key(
    hardware: Path, sections: Mapping[str, Any], files: Iterable[str | Path], code: str
) -> str:
    """One digest of everything the planner reads: hardware.json's bytes, its config sections
    (as the rule passes them), the local files it reads (a table, a start model's config) and
    the digest of its code."""
    record = {
        "code": code,
        "files": {str(p): _sha256(Path(p).read_bytes()) for p in sorted(map(str, files))},
        "hardware.json": _sha256(Path(hardware).read_bytes()),
        "sections": sections,
    }
    return _sha256(json.dumps(record, sort_keys=True).encode("utf-8"))


def plan_ahead(
    plan_json: Path,
    key: str,
    hardware: Path,
    sections: Mapping[str, Any],
    *,
    cache: Path | None = None,
    shapes: Path | None = None,
) -> PlanRecord | str:
    """plan.json as the planner's job writes it for these inputs: the recorded one if it was
    planned from them, else the plan an earlier DAG worked out from them (`cache`: the folder of
    such plans, by key, so that a dry run and the run after it plan once), else planned now; or
    the planner's one-line refusal of them, which the jobs that would write the plan fail with
    (so the error lands in their logs, as a stage's). `shapes`: the folder of the model shapes
    counted before (`planning.shape.cached_shape`), so that a replan whose model did not change
    imports neither torch nor transformers."""
    for path in (Path(plan_json), *([cache / f"{key}.json"] if cache else [])):
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(recorded, dict) and recorded.get(INPUTS_KEY) == key:
            return cast(
                PlanRecord, recorded
            )  # written by this planner's code: the key has its digest
    from stagetrain.config import validation as cfg
    from stagetrain.planning.resolve import plan_from

    try:
        valid = {name: cfg.validate_section(name, value) for name, value in sections.items()}
        plan = plan_from(json.loads(Path(hardware).read_text()), valid, shapes=shapes)
    except StageError as err:
        return str(err)
    if cache is not None:
        _remember(cache, key, plan)
    return plan


def _remember(cache: Path, key: str, plan: PlanRecord, keep: int = 8) -> None:
    """Keep `plan` in `cache` under its key, and only the newest `keep` plans there."""
    atomic_write_json(cache / f"{key}.json", {**plan, INPUTS_KEY: key})
    try:  # dry runs side by side prune the same folder
        for old in sorted(cache.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-keep]:
            old.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
