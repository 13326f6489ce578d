"""The analytic planner: enumerate layouts, model each one, keep the fastest that fits.

Searched: tp (dividing the heads, the KV heads and the devices of a node), ep
(dividing dp and the routed experts, for an architecture AutoEP splits, with tp 1 and
ZeRO 1-3; GRPO takes only a fixed one), ZeRO stage 0-3, micro batch size (dividing the per-rank
batch), activation checkpointing; CPU offload only when nothing else fits. Values fixed by the
config or a parallelism table narrow the search instead of being searched.
Candidates are ranked by predicted speed (`throughput.predict`, from the catalog
peak on GPUs and the measured matrix-product rate on CPU ranks); without a
measurement the planner takes the fewest micro batches per step, then the lowest
ZeRO stage, without recomputation. tp > 1 is never combined with ZeRO-3:
DeepSpeed's AutoTP training supports ZeRO stages 0-2 only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import product
from typing import cast

from stagetrain.config.settings import DeepSpeedSettings, ParallelismSettings
from stagetrain.errors import StageError
from stagetrain.hardware.catalog import GpuSpec
from stagetrain.model.architectures import expert_parallel_refusal
from stagetrain.planning import memory as mem
from stagetrain.planning.plan import (
    CandidateRecord,
    Layout,
    MemoryRecord,
    NoThroughput,
    Offload,
    Precision,
    StageSearch,
    TableEntry,
    ThroughputRecord,
)
from stagetrain.planning.shape import ModelShape
from stagetrain.planning.throughput import Rates, Throughput, predict

RUNNERS_UP = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class Fixed:
    """The searched values already decided, by the config or a parallelism table; None: searched."""

    dp: int | None = None
    tp: int | None = None
    ep: int | None = None
    micro_batch_size: int | None = None
    zero_stage: int | None = None
    activation_checkpointing: bool | None = None
    offload: Offload | None = None

    @classmethod
    def of(cls, parallelism: ParallelismSettings) -> Fixed:
        """The values the `parallelism` section sets."""
        return cls(**{name: getattr(parallelism, name) for name in SEARCHED})

    def given(self) -> dict[str, int | bool | str]:
        """The decided values by name, in SEARCHED order."""
        values = ((name, getattr(self, name)) for name in SEARCHED)
        return {name: value for name, value in values if value is not None}

    def under(self, entry: TableEntry) -> Fixed:
        """These values, with a table `entry`'s where these leave one open."""
        return replace(
            self,
            dp=entry["dp"] if self.dp is None else self.dp,
            tp=entry["tp"] if self.tp is None else self.tp,
            micro_batch_size=(
                entry["micro_batch_size"]
                if self.micro_batch_size is None
                else self.micro_batch_size
            ),
        )


SEARCHED = tuple(f.name for f in fields(Fixed))
"""The values the planner searches (plan.json's `sources` has one per name)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Knobs:
    """The config sections whose values the memory and speed models use."""

    parallelism: ParallelismSettings
    deepspeed: DeepSpeedSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class Devices:
    """What the planner plans for, read from hardware.json."""

    gpu: GpuSpec | None
    """None on a CPU machine."""
    nodes: int
    per_node: int
    """GPUs (or CPU ranks) per node."""
    device_bytes: int
    """Memory of one device (CPU: host memory per rank)."""
    host_bytes_per_node: int | None
    inter_node_gbps: float

    @property
    def world(self) -> int:
        """Ranks over all nodes."""
        return self.nodes * self.per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class Demand:
    """What one training stage asks of the plan."""

    stage: str
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    group: int = 1
    """Sequences that must stay on one rank together (GRPO: one prompt's completions)."""
    expert_parallel: bool = True
    """Whether the stage can split experts (ep > 1). GRPO's generation sends tokens between the
    ranks of an ep group at every forward, so every rank must make the same number of forwards:
    flat rollouts and the held-out chunks can (`training.evaluation.in_lockstep`), tree rollouts
    cannot."""
    search_ep: bool = True
    """Whether the search may choose ep > 1 itself. GRPO's may not: the all-to-alls of its
    generation, two per MoE layer at every decoded token, are not in the throughput model, so
    GRPO takes the ep that the config (or a table) fixes, and 1 otherwise."""
    extra_bytes: Callable[[ModelShape, Layout], int] = field(default=lambda shape, layout: 0)
    per_token_extra_bytes: Callable[[ModelShape, Layout], int] | None = None
    """GRPO's extra memory where its generation gathers ZeRO-3's partitions per token instead of
    the whole policy at once: the fallback when no layout fits `extra_bytes`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluated:
    """A candidate layout with its predicted memory and speed."""

    layout: Layout
    memory: mem.Memory
    fits: bool
    throughput: Throughput | None
    usable: int

    def summary(self) -> str:
        """A short human-readable form, e.g. 'tp=2 zero=1 mbs=4 ga=2 ac=off offload=none'."""
        lay = self.layout
        return (
            f"tp={lay.tp} dp={lay.dp}{f' ep={lay.ep}' if lay.ep > 1 else ''} zero={lay.zero_stage} mbs={lay.micro_batch_size} "
            f"ga={lay.grad_accum} ac={'on' if lay.activation_checkpointing else 'off'} "
            f"offload={lay.offload}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _eps(demand: Demand, fixed: Fixed, model: ModelShape, tp: int, dp: int) -> list[int]:
    """The ep values to try at this tp and dp: the fixed one where it can split the experts here
    (none where it cannot: AutoEP trains with tp 1, in groups of ep of the dp ranks), or every
    one that can."""
    if not demand.expert_parallel:
        return [1]
    if fixed.ep:
        return [fixed.ep] if fixed.ep == 1 or tp == 1 and dp % fixed.ep == 0 else []
    if tp > 1 or not demand.search_ep or expert_parallel_refusal(model.model_type):
        return [1]
    return [e for e in _divisors(dp) if model.num_experts % e == 0]


def _candidates(
    demand: Demand,
    devices: Devices,
    fixed: Fixed,
    shape: Callable[[int], ModelShape],
    precision: Precision,
    offloads: tuple[Offload, ...],
    max_mbs: int,
) -> Iterator[Layout]:
    heads = shape(1)
    if fixed.tp:
        tps = [fixed.tp]
    elif fixed.dp:
        tps = [devices.world // fixed.dp]
    elif devices.gpu is None:
        tps = [1]
    else:
        tps = [
            t for t in _divisors(devices.per_node)
            if heads.num_heads % t == 0 and heads.num_kv_heads % t == 0
        ]  # fmt: skip
    for tp in tps:
        dp = fixed.dp or devices.world // tp
        per_rank, rest = divmod(demand.global_batch, dp)
        if rest or per_rank % demand.group:
            continue
        mbs_options = (
            [fixed.micro_batch_size]
            if fixed.micro_batch_size
            else [d for d in _divisors(per_rank) if d <= max_mbs]
        )
        zeros = [fixed.zero_stage] if fixed.zero_stage is not None else [0, 1, 2, 3]
        acs = (
            [fixed.activation_checkpointing]
            if fixed.activation_checkpointing is not None
            else [False, True]
        )
        eps = _eps(demand, fixed, heads, tp, dp)
        for ep, mbs, zero, ac, offload in product(eps, mbs_options, zeros, acs, offloads):
            if offload != "none" and zero < 2 or offload == "optimizer_and_params" and zero != 3:
                continue
            if tp > 1 and zero == 3 or ep > 1 and zero == 0:
                continue
            yield Layout(
                world=devices.world,
                gpus_per_node=devices.per_node,
                dp=dp,
                tp=tp,
                ep=ep,
                micro_batch_size=mbs,
                grad_accum=max(1, per_rank // mbs),
                global_batch=demand.global_batch,
                seq_len=demand.seq_len,
                zero_stage=zero,
                activation_checkpointing=ac,
                offload=offload,
                precision=precision,
                num_heads=shape(tp).num_heads,
                num_kv_heads=shape(tp).num_kv_heads,
                num_experts=heads.num_experts,
            )


def _evaluate(
    layout: Layout,
    shape: ModelShape,
    devices: Devices,
    demand: Demand,
    knobs: Knobs,
    rates: Rates | None,
) -> Evaluated:
    parallelism, deepspeed = knobs.parallelism, knobs.deepspeed
    memory = mem.estimate(
        shape,
        layout,
        bucket_size=deepspeed.bucket_size,
        max_live=deepspeed.stage3_max_live_parameters,
        overlap_comm=deepspeed.overlap_comm,
        extra=demand.extra_bytes(shape, layout),
    )
    reserved = parallelism.reserved_gib if devices.gpu else 0.0
    usable = mem.usable_bytes(devices.device_bytes, reserved, parallelism.fragmentation)
    host_ok = layout.offload == "none" or (
        devices.host_bytes_per_node is not None
        and memory.host_per_node <= devices.host_bytes_per_node
    )
    throughput = None
    if rates is not None:
        throughput = predict(
            shape,
            layout,
            rates,
            nodes=devices.nodes,
            inter_node_gbps=devices.inter_node_gbps,
            overlap_comm=deepspeed.overlap_comm,
        )
    return Evaluated(
        layout=layout, memory=memory, fits=memory.total <= usable and host_ok,
        throughput=throughput, usable=usable,
    )  # fmt: skip


def _rank(ev: Evaluated) -> tuple:
    """Sort key, best first: predicted speed (or, with no prediction, fewest micro batches), then simplicity."""
    lay = ev.layout
    speed = -round(ev.throughput.tokens_per_s, 6) if ev.throughput else lay.grad_accum
    offload = ("none", "optimizer", "optimizer_and_params").index(lay.offload)
    return (speed, offload, lay.zero_stage, lay.activation_checkpointing, lay.tp, lay.ep,
            ev.memory.total)  # fmt: skip


def _why_lost(loser: Evaluated, winner: Evaluated) -> str:
    if not loser.fits:
        gib = mem.GIB
        if loser.memory.total > loser.usable:
            return f"does not fit: needs {loser.memory.total / gib:.2f} GiB of {loser.usable / gib:.2f} GiB usable"
        return "does not fit: host memory for offload"
    lw, ll = winner.layout, loser.layout
    if winner.throughput and loser.throughput:
        slower = 1 - loser.throughput.tokens_per_s / winner.throughput.tokens_per_s
        if slower > 0.005:
            return (
                f"{slower:.0%} slower: {loser.throughput.tokens_per_s:,.0f} tokens/s "
                f"vs {winner.throughput.tokens_per_s:,.0f}"
            )
    elif ll.grad_accum != lw.grad_accum:
        return f"more micro batches per step (ga={ll.grad_accum} vs {lw.grad_accum})"
    if ll.offload != lw.offload:
        return f"offloads ({ll.offload}) where {lw.offload} fits as well"
    if ll.zero_stage != lw.zero_stage:
        return f"no faster, with more sharding traffic (ZeRO {ll.zero_stage} vs {lw.zero_stage})"
    if ll.activation_checkpointing != lw.activation_checkpointing:
        return "no faster, and recomputes activations"
    if ll.tp != lw.tp:
        return f"no faster, with tp={ll.tp} vs {lw.tp}"
    if ll.ep != lw.ep:
        return f"no faster, with ep={ll.ep} vs {lw.ep}"
    return f"no faster, and needs more memory ({loser.memory.total / mem.GIB:.2f} GiB)"


def _report(ev: Evaluated, best: Evaluated) -> CandidateRecord:
    """A layout the planner did not choose, and why `best` won over it."""
    return {
        "layout": ev.summary(),
        "tokens_per_s": round(ev.throughput.tokens_per_s, 1) if ev.throughput else None,
        "memory_gib": round(ev.memory.total / mem.GIB, 3),
        "reason": _why_lost(ev, best),
    }


def _evaluate_all(
    demand: Demand,
    devices: Devices,
    fixed: Fixed,
    shape: Callable[[int], ModelShape],
    precision: Precision,
    knobs: Knobs,
    rates: Rates | None,
) -> list[Evaluated]:
    """Every candidate layout, evaluated; offloading is tried only when nothing fits without it.

    Raises:
        StageError: no layout divides the batch over the ranks.
    """
    fixed_offload = fixed.offload
    offload_sets: list[tuple[Offload, ...]] = (
        [(fixed_offload,)] if fixed_offload else [("none",), ("optimizer", "optimizer_and_params")]
    )
    evaluated: list[Evaluated] = []
    for offloads in offload_sets:
        for layout in _candidates(
            demand,
            devices,
            fixed,
            shape,
            precision,
            offloads,
            knobs.parallelism.max_micro_batch_size,
        ):
            evaluated.append(_evaluate(layout, shape(layout.tp), devices, demand, knobs, rates))
        if any(e.fits for e in evaluated):
            break
    if not evaluated:
        raise StageError(
            f"{demand.stage}: no layout divides the global batch of {demand.global_batch} sequences "
            f"(groups of {demand.group}) over {devices.world} ranks with tp dividing the "
            f"{shape(1).num_heads} heads, {shape(1).num_kv_heads} KV heads and {devices.per_node} "
            f"devices per node; fixed: {fixed.given()}"
        )
    return evaluated


def _need(ev: Evaluated, host_bytes: int | None) -> str:
    """What a layout that does not fit needs: device memory, and for an offload whose device
    memory fits, the host memory it lacks (so the line names what is short)."""
    gib = mem.GIB
    need = f"{ev.memory.total / gib:.2f} GiB per device of {ev.usable / gib:.2f} usable"
    if ev.layout.offload != "none" and ev.memory.total <= ev.usable:
        have = (
            "none described (hardware.host_memory_gib)"
            if host_bytes is None
            else f"{host_bytes / gib:.2f}"
        )
        need += f" and {ev.memory.host_per_node / gib:.2f} GiB of host memory per node for its offload, of {have}"
    return need


def _choose(
    demand: Demand, evaluated: list[Evaluated], fixed: Fixed, host_bytes: int | None = None
) -> tuple[Evaluated, list[Evaluated], list[str]]:
    """The best layout, the fitting ones best first, and warnings. When none fits, the smallest
    is kept with a warning if the config fixed something, else it is an error.

    Raises:
        StageError: nothing fits and nothing was fixed.
    """
    fitting = sorted((e for e in evaluated if e.fits), key=_rank)
    warnings: list[str] = []
    if fitting:
        best = fitting[0]
    else:
        best = min(evaluated, key=lambda e: e.memory.total)
        need = _need(best, host_bytes)
        if not fixed.given():
            raise StageError(
                f"{demand.stage}: nothing fits; the smallest layout ({best.summary()}) needs {need}: "
                f"use more or larger devices{', more host memory' if 'host memory' in need else ''}, "
                "a shorter sequence or a smaller model"
            )
        warnings.append(
            f"{demand.stage}: the requested layout is predicted not to fit ({best.summary()} needs "
            f"{need}); kept because it was asked for"
        )
    return best, fitting, warnings


def search(
    demand: Demand,
    devices: Devices,
    fixed: Fixed,
    shape: Callable[[int], ModelShape],
    precision: Precision,
    knobs: Knobs,
    rates: Rates | None,
) -> StageSearch:
    """Choose the layout of one stage and explain the choice.

    Args:
        demand: the stage's sequence length, global batch and extra memory.
        devices: the hardware to plan for.
        fixed: values already decided (by the config or a table); None = search.
        shape: the model's shape for a given tp (the vocabulary padding depends on tp).
        precision: the training precision.
        knobs: the parallelism and deepspeed sections, whose values the models use.
        rates: one device's speed in `precision`; None: no throughput model.

    Returns:
        The stage's entry of plan.json (layout, memory, throughput, runners-up).

    Raises:
        StageError: no layout is possible, or none fits and nothing was fixed.
    """
    evaluated = _evaluate_all(demand, devices, fixed, shape, precision, knobs, rates)
    best, fitting, warnings = _choose(demand, evaluated, fixed, devices.host_bytes_per_node)
    if (fixed.ep or 1) > 1 and not demand.expert_parallel:
        warnings.append(
            f"{demand.stage}: trains with ep=1, not parallelism.ep={fixed.ep}: "
            "tree rollouts make different numbers of forwards on each rank, and every rank of "
            "an ep group must make the same; flat rollouts train at the config's ep"
        )
    others = [e for e in fitting[1:] if e.summary() != best.summary()]
    rejected = sorted((e for e in evaluated if not e.fits), key=lambda e: e.memory.total)
    return {
        "layout": best.layout.to_json(),
        "memory": _memory_record(best, devices),
        "throughput": _throughput_record(best.throughput),
        "candidates": {"considered": len(evaluated), "fit": len(fitting)},
        "runners_up": [_report(e, best) for e in others[:RUNNERS_UP]],
        "rejected": [_report(e, best) for e in rejected[:RUNNERS_UP]],
        "warnings": warnings,
    }


def _memory_record(best: Evaluated, devices: Devices) -> MemoryRecord:
    """plan.json's `memory`: the chosen layout's bytes by part (MemoryRecord names
    `mem.Memory`'s fields), its total, and what the device has."""
    record = {**asdict(best.memory), "total": best.memory.total, "usable": best.usable,
              "device": devices.device_bytes, "fits": best.fits}  # fmt: skip
    return cast(MemoryRecord, record)


def _throughput_record(throughput: Throughput | None) -> ThroughputRecord | NoThroughput:
    """plan.json's `throughput` (ThroughputRecord names `Throughput`'s fields), or why there is none."""
    if throughput is None:
        return {
            "reason": "no measured speed of these CPU ranks in hardware.json; the training stage measures it"
        }
    return cast(ThroughputRecord, {**asdict(throughput), "step_s": throughput.step_s})
