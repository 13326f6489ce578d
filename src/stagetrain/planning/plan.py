"""The parallel layout of one training stage, validated on construction.

plan_parallelism builds it (with the head counts it checks tp against) and
writes `stages.<stage>.layout` with `to_json`; the training stages read it back
with `from_plan`, where a missing or unknown key is one line naming plan.json
instead of a KeyError deep in a rank, and a typo in a field name is an
AttributeError at the line that made it. One class, so the field list is
written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from stagetrain.errors import StageError

Precision = Literal["bf16", "fp16", "fp32"]
Offload = Literal["none", "optimizer", "optimizer_and_params"]
MODEL_FACTS = ("num_heads", "num_kv_heads")
"""Fields the planner checks tp against but plan.json does not store."""


def factor_misfit(
    *,
    world: int,
    per_node: int,
    dp: int | None,
    tp: int | None,
    zero_stage: int | None,
    heads: int | None,
    kv_heads: int | None,
) -> tuple[str, str] | None:
    """The first of dp and tp that cannot form a layout of `world` ranks, and why; None if both can.

    The one check of these factors: the planner runs it on the values a config or
    a table fixes before it searches (None: not fixed), and every `Layout` on itself
    (heads None: a layout read back from plan.json, which does not store them).
    The reason starts with its subject ('tp must divide ...'); callers add the factors.
    """
    if tp and heads is not None and kv_heads is not None and (heads % tp or kv_heads % tp):
        return "tp", "tp must divide the attention and KV heads"
    if tp and per_node % tp:
        return "tp", f"tp must divide the {per_node} devices of one node"
    if dp and tp and dp * tp != world or dp and world % dp or tp and world % tp:
        return ("dp" if dp else "tp"), "dp * tp must equal the world size"
    if (tp or 1) > 1 and zero_stage == 3:
        return "tp", "tp > 1 (DeepSpeed AutoTP) trains with ZeRO stages 0-2 only, not zero_stage 3"
    return None


def parallelism_error(key: str, why: str) -> StageError:
    """'parallelism.tp: must divide ...', not 'parallelism.tp: tp must divide ...'."""
    return StageError(f"parallelism.{key}: {why.replace(f'{key} must ', 'must ', 1)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One way to run a stage: how ranks split the model and the batch.

    Invariants (checked in __post_init__, with every factor in the message):
    dp * tp == world, tp divides the heads and KV heads and fits in a node,
    global_batch == micro_batch_size * grad_accum * dp, tp > 1 only with ZeRO 0-2
    (DeepSpeed's AutoTP training supports no ZeRO-3).
    """

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
    offload: Offload
    precision: Precision
    num_heads: int | None = None
    """Attention heads tp must divide; None in a layout read back from plan.json (not stored)."""
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        factors = (
            f"dp={self.dp}, tp={self.tp}, world={self.world}, micro_batch_size={self.micro_batch_size}, "
            f"grad_accum={self.grad_accum}, global_batch={self.global_batch}, "
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}"
        )
        if min(self.dp, self.tp, self.micro_batch_size, self.grad_accum) < 1:
            raise StageError(f"parallelism: every factor must be >= 1 ({factors})")
        problem = factor_misfit(
            world=self.world, per_node=self.gpus_per_node, dp=self.dp, tp=self.tp,
            zero_stage=self.zero_stage, heads=self.num_heads, kv_heads=self.num_kv_heads,
        )  # fmt: skip
        if problem:
            raise parallelism_error(problem[0], f"{problem[1]} ({factors})")
        if self.micro_batch_size * self.grad_accum * self.dp != self.global_batch:
            raise StageError(
                f"parallelism: global batch must equal micro_batch_size * grad_accum * dp ({factors})"
            )
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            raise StageError(
                f"parallelism.offload: parameter offload needs zero_stage 3 ({factors})"
            )
        if self.offload != "none" and self.zero_stage < 2:
            raise StageError(
                f"parallelism.offload: CPU offload needs zero_stage 2 or 3 ({factors})"
            )

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all ranks."""
        return self.global_batch * self.seq_len

    def to_json(self) -> dict[str, Any]:
        """The layout as plan.json stores it, without the model facts it was checked against
        (summary.json and the consolidation's manifest repeat it)."""
        out = asdict(self)
        del out["num_heads"], out["num_kv_heads"]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "plan.json") -> Layout:
        """The layout `data` describes (as `to_json` wrote it); `where` names it in the one-line error.

        Raises:
            StageError: a key missing or unknown (a plan of another stagetrain
                version), or factors that do not form a layout.
        """
        names = {f.name for f in fields(cls)} - set(MODEL_FACTS)
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise StageError(
                f"{where}: the layout {'lacks ' + ', '.join(missing) if missing else 'has unknown ' + ', '.join(unknown)} "
                "(planned by another stagetrain): replan with `snakemake --cores all --forcerun plan_parallelism`"
            )
        try:
            return cls(**{k: data[k] for k in names})
        except StageError as err:
            raise StageError(f"{where}: {err}") from None

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any], stage: str) -> Layout:
        """`plan["stages"][stage]["layout"]`, typed."""
        return cls.from_json(
            plan["stages"][stage]["layout"], where=f"plan.json stages.{stage}.layout"
        )

    @property
    def checkpoint_layout(self) -> dict[str, int]:
        """What a checkpoint's files depend on: a resume under another one converts it (training.reshard)."""
        return {"dp": self.dp, "tp": self.tp, "zero_stage": self.zero_stage}
