"""The parallel layout of one training stage, validated on construction, and plan.json's shape.

plan_parallelism builds the layout (with the head counts it checks tp against) and
writes `stages.<stage>.layout` with `to_json`; the training stages read it back
with `from_plan`, where a missing or unknown key is one line naming plan.json
instead of a KeyError deep in a rank, and a typo in a field name is an
AttributeError at the line that made it.

plan.json and its parts stay plain JSON dicts from the planner to the stages, so their
bytes are what they were; `PlanRecord`, `PlanPart` and the records they hold are the
TypedDicts that name their keys (docs/architecture.md, "Contracts between stages").
Records that copy a dataclass field by field (`LayoutRecord`, `MemoryRecord`,
`ThroughputRecord`, `ModelRecord`) are held to it by tests/test_planning.py. No
`from __future__ import annotations` here: Python 3.11 reads `NotRequired` only from evaluated
annotations (`__required_keys__`, which that test checks).
"""

from dataclasses import asdict, dataclass, fields
from typing import Literal, NotRequired, Self, TypedDict, cast, final

from stagetrain.errors import StageError

Precision = Literal["bf16", "fp16", "fp32"]
Offload = Literal["none", "optimizer", "optimizer_and_params"]
Attention = Literal["sdpa", "eager"]
MODEL_FACTS = ("num_heads", "num_kv_heads", "num_experts")
"""Fields the planner checks tp and ep against but plan.json does not store."""


class LayoutRecord(TypedDict):
    """`stages.<stage>.layout`: `Layout` as JSON, less MODEL_FACTS."""

    world: int
    gpus_per_node: int
    dp: int
    tp: int
    ep: int
    micro_batch_size: int
    grad_accum: int
    global_batch: int
    seq_len: int
    zero_stage: int
    activation_checkpointing: bool
    offload: Offload
    precision: Precision


class MemoryRecord(TypedDict):
    """`stages.<stage>.memory`: `memory.Memory`'s bytes by part, and the verdict."""

    params: int
    grads: int
    optimizer: int
    zero_buffers: int
    activations: int
    logits: int
    extra: int
    host_per_node: int
    total: int
    usable: int
    device: int
    fits: bool


@final
class ThroughputRecord(TypedDict):
    """`stages.<stage>.throughput` where there is a prediction: `throughput.Throughput`."""

    compute_s: float
    dp_comm_s: float
    tp_comm_s: float
    ep_comm_s: float
    offload_s: float
    tokens_per_s: float
    mfu: float
    step_s: float


@final
class NoThroughput(TypedDict):
    """`stages.<stage>.throughput` without a prediction: why there is none."""

    reason: str


class CandidateCounts(TypedDict):
    """`stages.<stage>.candidates`: layouts considered, and how many fit."""

    considered: int
    fit: int


class CandidateRecord(TypedDict):
    """One of `runners_up` or `rejected`: a layout the planner did not choose, and why."""

    layout: str
    tokens_per_s: float | None
    memory_gib: float
    reason: str


class GenerationRecord(TypedDict):
    """GRPO's `generation`: the most sequences one rank generates in one call, and how ZeRO-3's
    partitions are gathered for it: "whole" (once per phase, the whole policy on every rank, under
    ep with its share of the experts; also what ZeRO 0-2 hold anyway) or "per_token" (a layer at a time at every forward, the ranks in
    lockstep), where no layout fits the whole policy gathered."""

    batch: int
    gather: Literal["whole", "per_token"]


class StageDecision(TypedDict):
    """What the search decides for a stage: the keys a stage's part of the plan keeps."""

    layout: LayoutRecord
    memory: MemoryRecord
    candidates: CandidateCounts
    rejected: list[CandidateRecord]
    warnings: list[str]


class StageEstimates(TypedDict):
    """The keys that predict rather than decide (`derived.ESTIMATES`): plan.json only."""

    throughput: ThroughputRecord | NoThroughput
    runners_up: list[CandidateRecord]


class StageSearch(StageDecision, StageEstimates):
    """What `search.search` returns for one stage."""


class StagePart(StageDecision):
    """`stages.<stage>` of plan/<stage>.json: the decision and where its values came from."""

    sources: dict[str, str]
    """Where each searched value came from: config, a table's source, planner, or model (the ep
    of a model AutoEP does not split)."""
    generation: NotRequired[GenerationRecord]
    """GRPO's stage only."""


class StagePlanRecord(StagePart, StageEstimates):
    """`stages.<stage>` of plan.json."""


class ModelRecord(TypedDict):
    """plan.json's `model`: `shape.ModelShape` of the unpadded model, and the vocab multiple."""

    params: int
    active_params: int
    layer_params: int
    embedding_params: int
    largest_module_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    experts_per_token: int
    num_experts: int
    expert_params: int
    moe_layers: int
    model_type: str
    vocab_size: int
    kv_cache_width: int
    vocab_multiple: int


class TableEntry(TypedDict):
    """One entry of a parallelism table (`table`): the layout values it fixes.

    Defined here, not in `table`, so that the training stages, which read plan.json,
    do not reach the table reader's code (`codedeps`)."""

    dp: int
    tp: int
    micro_batch_size: int


class TableRecord(TypedDict):
    """plan.json's `table`: whether a parallelism table was used, with its source or why not."""

    status: Literal["used", "miss", "none", "skipped", "not needed"]
    reason: NotRequired[str]
    """Every status but used."""
    source: NotRequired[str]
    """used: file:<path> or hub:<repo>@<commit>."""
    entry: NotRequired[TableEntry]
    """used: the entry taken."""


class RunWide(TypedDict):
    """The run-wide keys the training stages read (`derived.SHARED_KEYS`)."""

    attention: Attention
    backend: Literal["nccl", "gloo"]
    device: str
    """The GPUs' catalog key, or cpu."""
    model: ModelRecord
    nodes: int
    precision: Precision
    ranks_per_node: int
    world: int


class PlanRecord(RunWide):
    """plan.json."""

    source: str
    """config, file:<path>, hub:<repo>@<commit> or estimated."""
    precision_reason: str
    attention_reason: str
    table: TableRecord
    stages: dict[str, StagePlanRecord]
    warnings: list[str]
    inputs_sha256: NotRequired[str | None]
    """The digest of the planner's inputs (`ahead.inputs_key`): in the written file (None when
    the script planned on its own), not in `resolve.resolve`'s result."""


class PlanPart(RunWide):
    """plan/<stage>.json: the run-wide keys and the one stage, less its estimates."""

    stages: dict[str, StagePart]


class VocabPart(TypedDict):
    """plan/vocab.json: the tp the padded vocabulary must divide by."""

    tp: int


def factor_misfit(
    *,
    world: int,
    per_node: int,
    dp: int | None,
    tp: int | None,
    zero_stage: int | None,
    heads: int | None,
    kv_heads: int | None,
    ep: int | None = None,
    experts: int | None = None,
) -> tuple[str, str] | None:
    """The first of dp, tp and ep that cannot form a layout of `world` ranks, and why; None if all can.

    The one check of these factors: the planner runs it on the values a config or
    a table fixes before it searches (None: not fixed), and every `Layout` on itself
    (heads and experts None: a layout read back from plan.json, which does not store them).
    The reason starts with its subject ('tp must divide ...'); callers add the factors.

    ep > 1 (DeepSpeed AutoEP) splits each MoE layer's routed experts over groups of ep
    data-parallel ranks, so ep divides dp and the experts. AutoEP refuses tensor parallelism
    from outside it, and ZeRO-0 writes expert optimizer files that DeepSpeed's universal
    converter, which consolidation and elastic resume read AutoEP checkpoints through, does
    not read; both are refused here.
    """
    if tp and heads is not None and kv_heads is not None and (heads % tp or kv_heads % tp):
        return "tp", "tp must divide the attention and KV heads"
    if tp and per_node % tp:
        return "tp", f"tp must divide the {per_node} devices of one node"
    if dp and tp and dp * tp != world or dp and world % dp or tp and world % tp:
        return ("dp" if dp else "tp"), "dp * tp must equal the world size"
    if (tp or 1) > 1 and zero_stage == 3:
        return "tp", "tp > 1 (DeepSpeed AutoTP) trains with ZeRO stages 0-2 only, not zero_stage 3"
    if ep is not None and ep > 1:
        if experts is not None and (not experts or experts % ep):
            what = (
                f"the {experts} routed experts of each MoE layer"
                if experts
                else "a model with routed experts (this one is dense)"
            )
            return "ep", f"ep must divide {what}"
        if (tp or 1) > 1:
            return "ep", "ep > 1 (DeepSpeed AutoEP) trains with tp 1 only"
        if dp and dp % ep or world % ep:
            return (
                "ep",
                "ep must divide dp (each group of ep data-parallel ranks shares out the experts)",
            )
        if zero_stage == 0:
            return (
                "ep",
                "ep > 1 needs zero_stage 1-3 (DeepSpeed's universal converter, which reads AutoEP checkpoints, reads no ZeRO-0 one)",
            )
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
    (DeepSpeed's AutoTP training supports no ZeRO-3), ep > 1 only dividing dp and the routed
    experts, with tp 1 and ZeRO 1-3 (`factor_misfit`).
    """

    world: int
    gpus_per_node: int
    """Ranks per node (CPU: ranks per machine)."""
    dp: int
    tp: int
    ep: int = 1
    """Expert-parallel ranks (DeepSpeed AutoEP): each of a group of ep data-parallel ranks holds
    1/ep of every MoE layer's routed experts; 1 for a dense model and without AutoEP."""
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
    num_experts: int | None = None
    """Routed experts per MoE layer, which ep must divide (0: dense); None as num_heads."""

    def __post_init__(self) -> None:
        factors = (
            f"dp={self.dp}, tp={self.tp}, world={self.world}, micro_batch_size={self.micro_batch_size}, "
            f"grad_accum={self.grad_accum}, global_batch={self.global_batch}, "
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}"
            + (f", ep={self.ep}, experts={self.num_experts}" if self.ep > 1 else "")
        )
        if min(self.dp, self.tp, self.ep, self.micro_batch_size, self.grad_accum) < 1:
            raise StageError(f"parallelism: every factor must be >= 1 ({factors})")
        problem = factor_misfit(
            world=self.world, per_node=self.gpus_per_node, dp=self.dp, tp=self.tp,
            zero_stage=self.zero_stage, heads=self.num_heads, kv_heads=self.num_kv_heads,
            ep=self.ep, experts=self.num_experts,
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

    def to_json(self) -> LayoutRecord:
        """The layout as plan.json stores it, without the model facts it was checked against
        (summary.json and the consolidation's manifest repeat it)."""
        out = asdict(self)
        for fact in MODEL_FACTS:
            del out[fact]
        return cast(LayoutRecord, out)

    @classmethod
    def from_json(cls, data: LayoutRecord, *, where: str = "plan.json") -> Self:
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
            return cls(**data)  # exactly the fields less MODEL_FACTS: checked above
        except StageError as err:
            raise StageError(f"{where}: {err}") from None

    @classmethod
    def from_plan(cls, plan: PlanRecord | PlanPart, stage: str) -> Self:
        """`plan["stages"][stage]["layout"]`, typed: plan.json or plan/<stage>.json as read."""
        return cls.from_json(
            plan["stages"][stage]["layout"], where=f"plan.json stages.{stage}.layout"
        )

    @property
    def checkpoint_layout(self) -> dict[str, int]:
        """What a checkpoint's files depend on: a resume under another one converts it (training.reshard)."""
        split = {"ep": self.ep} if self.ep > 1 else {}  # absent: 1, as before ep existed
        return {"dp": self.dp, "tp": self.tp, **split, "zero_stage": self.zero_stage}


def verifies_on_gpu(need: int, free: int | None) -> bool:
    """Whether the loss verification runs on a GPU: there is one (`free`: its free bytes) and
    `need` bytes, the reloaded model and one batch of logits, fit in it with a fifth to spare.
    The stage decides with it (`consolidate.folder`) and its Slurm job asks for a GPU by it
    (`workflow.slurm`), so it lives here: torch-free, and in both their digests without putting
    consolidation's code into pretraining's. Elsewhere the CPU verifies in host memory, which
    also holds a model too large for one GPU."""
    return free is not None and need * 1.2 <= free
