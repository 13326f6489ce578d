"""The typed contract of a stage's layout in plan.json: how the stage's ranks split model and batch.

plan_parallelism writes `stages.<stage>.layout` (stagetrain.planning.plan.Layout,
less the head counts it checks tp against); the training stages, the
consolidation and the Slurm profile read it. Read through `StageLayout` a
missing or unknown key is one line naming plan.json, instead of a KeyError deep
in a rank, and a typo in a field name is an AttributeError at the line that made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from stagetrain.errors import StageError


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """One stage's layout as plan.json holds it (field names are the JSON keys)."""

    world: int
    gpus_per_node: int
    """Ranks per node (CPU: ranks per machine)."""
    dp: int
    tp: int
    micro_batch_size: int
    grad_accum: int
    global_batch: int
    """Sequences per optimizer step over all ranks."""
    seq_len: int
    zero_stage: int
    activation_checkpointing: bool
    offload: str
    precision: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "plan.json") -> StageLayout:
        """The layout `data` describes; `where` names it in the one-line error.

        Raises:
            StageError: a key missing or unknown (a plan of another stagetrain version).
        """
        names = {f.name for f in fields(cls)}
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise StageError(
                f"{where}: the layout {'lacks ' + ', '.join(missing) if missing else 'has unknown ' + ', '.join(unknown)} "
                "(planned by another stagetrain): replan with `snakemake --cores all --forcerun plan_parallelism`"
            )
        return cls(**{k: data[k] for k in names})

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any], stage: str) -> StageLayout:
        """`plan["stages"][stage]["layout"]`, typed."""
        return cls.from_json(
            plan["stages"][stage]["layout"], where=f"plan.json stages.{stage}.layout"
        )

    def to_json(self) -> dict[str, Any]:
        """The dict plan.json holds (summary.json and the consolidation's manifest repeat it)."""
        return asdict(self)

    @property
    def checkpoint_layout(self) -> dict[str, int]:
        """What a checkpoint's files depend on: resuming under another one fails."""
        return {"dp": self.dp, "tp": self.tp, "zero_stage": self.zero_stage}
