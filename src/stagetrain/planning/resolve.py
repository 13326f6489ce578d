"""Resolve the plan: config values first, then a parallelism table, then the planner."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any, Literal, cast

from stagetrain.config.settings import (
    DeepSpeedSettings,
    GrpoSettings,
    HardwareSettings,
    ModelSettings,
    ParallelismSettings,
    PretrainSettings,
    TokenizerSettings,
)
from stagetrain.errors import StageError
from stagetrain.hardware.catalog import CATALOG_PATH, gpu_spec
from stagetrain.hardware.report import HardwareReport, SpeedReport
from stagetrain.model.architectures import expert_parallel_refusal
from stagetrain.planning import attention as attentions
from stagetrain.planning import precision as precisions
from stagetrain.planning import table as tables
from stagetrain.planning.memory import params_per_rank
from stagetrain.planning.plan import (
    Layout,
    ModelRecord,
    PlanRecord,
    Precision,
    StagePlanRecord,
    StageSearch,
    TableEntry,
    TableRecord,
    factor_misfit,
    parallelism_error,
)
from stagetrain.planning.search import SEARCHED, Demand, Devices, Fixed, Knobs, search
from stagetrain.planning.shape import ModelShape, cached_shape, model_shape, shape_key
from stagetrain.planning.throughput import Rates


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerSettings:
    """The config sections the planner reads, typed (`stagetrain.config.settings`).

    Built once where the planner is entered (`plan_from`, the DAG's `planning.ahead`, the
    stage script, the tests' harness); everything below reads attributes. pretrain and grpo
    may be built from sections that hold only the keys the planner reads
    (`ahead.PLAN_KEYS`) once validation filled the rest with defaults.
    """

    hardware: HardwareSettings
    model: ModelSettings
    tokenizer: TokenizerSettings
    parallelism: ParallelismSettings
    deepspeed: DeepSpeedSettings
    pretrain: PretrainSettings
    grpo: GrpoSettings

    @classmethod
    def from_config(cls, sections: Mapping[str, Mapping[str, Any]]) -> PlannerSettings:
        """From validated sections by name: the planner rule's params, or a whole config."""
        return cls(
            hardware=HardwareSettings.from_config(sections["hardware"], "hardware"),
            model=ModelSettings.from_config(sections["model"], "model"),
            tokenizer=TokenizerSettings.from_config(sections["tokenizer"], "tokenizer"),
            parallelism=ParallelismSettings.from_config(sections["parallelism"], "parallelism"),
            deepspeed=DeepSpeedSettings.from_config(sections["deepspeed"], "deepspeed"),
            pretrain=PretrainSettings.from_config(sections["pretrain"], "pretrain"),
            grpo=GrpoSettings.from_config(sections["grpo"], "grpo"),
        )


def devices_from(hardware: HardwareReport, hw_config: HardwareSettings) -> Devices:
    """The planner's view of hardware.json."""
    gpu = hardware["gpu"]
    if gpu is None:
        ranks, memory = hardware["cpu_ranks"], hardware["cpu"]["memory_bytes"]
        assert ranks is not None and memory is not None  # detected CPUs (`detect`) have both
        return Devices(
            gpu=None,
            nodes=hardware["nodes"],
            per_node=ranks,
            device_bytes=memory // ranks,
            host_bytes_per_node=None,
            inter_node_gbps=hw_config.inter_node_gbps,
        )
    if gpu["key"] is None:
        raise StageError(
            f"hardware.json: GPU {gpu['name']!r} is not in the catalog ({CATALOG_PATH}); "
            "expected a known GPU: add an entry for it there"
        )
    if gpu["memory_bytes"] is None:  # found in /proc, which gives no memory: no plan can fit
        raise StageError(
            f"hardware.json: the memory of GPU {gpu['name']!r} is unknown (source "
            f"{hardware['source']}); expected NVML to answer, or hardware.source: describe"
        )
    return Devices(
        gpu=gpu_spec(gpu["key"]),
        nodes=hardware["nodes"],
        per_node=hardware["gpus_per_node"],
        device_bytes=gpu["memory_bytes"],
        host_bytes_per_node=hardware["cpu"]["memory_bytes"],
        inter_node_gbps=hw_config.inter_node_gbps,
    )


def device_rates(
    devices: Devices,
    speed: SpeedReport | None,
    precision: Precision,
    attention: str,
    parallelism: ParallelismSettings,
) -> Rates | None:
    """One device's speed in `precision` (and `attention`, the plan's kernel) for the throughput
    model; None where nothing says it.

    GPUs run at the catalog's peak (a measurement of one card would not say
    what a described cluster does); CPU ranks at what detect_hardware measured.
    """
    if devices.gpu is not None:
        return Rates.of_gpu(devices.gpu, parallelism.assumed_mfu)
    gflops = (speed.get("gflops") if speed else None) or {}
    if precision not in gflops:
        return None
    probe = speed.get("attention_ms", {}).get(precision, {}).get(attention) if speed else None
    return Rates.of_cpu_rank(gflops[precision], parallelism.cpu_efficiency, probe)


def generation_batch(grpo: GrpoSettings, dp: int) -> int:
    """Sequences one rank generates in one `generate` call: its share of the prompts times the group.

    Flat rollouts sample every prompt of the rank's share at once; held-out
    evaluation and tree expansions generate in chunks of at most this many
    (grpo.rollouts, grpo.steps), so this is the generation memory to plan for.
    """
    return max(1, grpo.prompts_per_step // dp) * grpo.group_size


def _table_repo(parallelism: ParallelismSettings, init_from: str | None) -> str | None:
    if parallelism.table_repo:
        return parallelism.table_repo
    return init_from if init_from and not Path(init_from).exists() else None


def misfit(
    fixed: Fixed,
    devices: Devices,
    heads: int,
    kv_heads: int,
    stages: Sequence[Demand] = (),
    experts: int | None = None,
) -> tuple[str, str] | None:
    """The first of dp, tp, ep, micro_batch_size (None: not fixed) that cannot form a layout, and why.

    With `stages`, also whether dp splits each stage's batch into whole groups per rank
    and the micro batch divides that per-rank batch. The reason starts with its subject
    (e.g. 'tp must divide ...') and lists every factor.
    """
    dp, tp, mbs = fixed.dp, fixed.tp, fixed.micro_batch_size
    world = devices.world
    problem = factor_misfit(world=world, per_node=devices.per_node, dp=dp, tp=tp, ep=fixed.ep,
                            zero_stage=fixed.zero_stage, heads=heads, kv_heads=kv_heads,
                            experts=experts)  # fmt: skip
    if problem:
        key, why = problem
        split = f", ep={fixed.ep}, experts={experts}" if (fixed.ep or 1) > 1 else ""
        return (
            key,
            f"{why} (dp={dp}, tp={tp}, world={world}, heads={heads}, kv_heads={kv_heads}{split})",
        )
    dp = dp or (world // tp if tp else None)
    for stage in stages if dp else ():
        assert dp is not None  # the loop runs only with dp
        per_rank, rest = divmod(stage.global_batch, dp)
        if rest or per_rank % stage.group:
            return "dp", (
                f"dp must split the {stage.stage} batch of {stage.global_batch} sequences into "
                f"whole groups of {stage.group} per rank (dp={dp})"
            )
        if mbs and per_rank % mbs:
            return "micro_batch_size", (
                f"micro_batch_size must divide the {stage.stage} batch of {per_rank} sequences "
                f"per rank (micro_batch_size={mbs}, dp={dp})"
            )
    return None


def check_fixed(fixed: Fixed, devices: Devices, model: ModelShape) -> None:
    """Fail early, with every factor, on dp, tp and ep values of the config that cannot form a
    layout of this model on these devices."""
    refusal = expert_parallel_refusal(model.model_type) if (fixed.ep or 1) > 1 else None
    if refusal:
        raise parallelism_error("ep", refusal)
    problem = misfit(fixed, devices, model.num_heads, model.num_kv_heads, experts=model.num_experts)
    if problem:
        raise parallelism_error(*problem)


def entry_misfit(
    entry: TableEntry,
    *,
    fixed: Fixed,
    devices: Devices,
    heads: int,
    kv_heads: int,
    stages: Sequence[Demand],
) -> str | None:
    """Why a table entry, under the values the config fixes itself, cannot form this run's layouts."""
    problem = misfit(fixed.under(entry), devices, heads, kv_heads, stages)
    return problem[1] if problem else None


def table_values(
    parallelism: ParallelismSettings,
    init_from: str | None,
    devices: Devices,
    fits: Callable[[TableEntry], str | None] = lambda entry: None,
) -> tuple[TableEntry | None, TableRecord]:
    """The entry of a parallelism table (None: no entry used), and a record of where it came
    from (or why not). `init_from` is model.init_from: a hub repo there is the default table repo.

    `fits` says why an entry cannot be used for this run (None if it can); such an
    entry is a miss like any other, naming the table and the entry.
    """
    repo = _table_repo(parallelism, init_from)
    if not parallelism.table_path and not repo:
        return None, {"status": "none", "reason": "no table_path or table_repo configured"}
    if devices.gpu is None:
        return None, {"status": "skipped", "reason": "tables describe GPUs; planning for CPU ranks"}
    try:
        if parallelism.table_path:
            table, source = tables.read_local(parallelism.table_path)
        else:
            assert repo is not None  # returned above with neither table_path nor repo
            table, source = tables.download(repo, parallelism.table_revision)
        entry = tables.lookup(table, devices.gpu.key, devices.world, source)
        why = fits(entry)
        if why:
            values = ", ".join(f"{k}={v}" for k, v in entry.items())
            raise tables.TableMiss(
                f"{source}: the entry for {devices.gpu.key} x {devices.world} ({values}) "
                f"does not fit this run: {why}"
            )
    except tables.TableMiss as miss:
        if parallelism.on_table_miss == "error":
            raise StageError(str(miss)) from None
        return None, {"status": "miss", "reason": f"{miss}; falling back to the planner"}
    return entry, {"status": "used", "source": source, "entry": entry}


def demands(pretrain: PretrainSettings, grpo: GrpoSettings, devices: Devices) -> list[Demand]:
    """The pretrain and GRPO stages' batch shapes (and GRPO's extra memory)."""
    seq = pretrain.seq_len
    batch = pretrain.global_batch_size
    if pretrain.global_batch_unit == "tokens":
        if batch % seq:
            raise StageError(
                f"pretrain.global_batch_size: {batch} tokens is not a multiple of pretrain.seq_len {seq}"
            )
        batch //= seq

    def grpo_extra(shape: ModelShape, layout: Layout, *, whole: bool = True) -> int:
        # Reference model for the KL term (built without AutoEP: every expert), the whole
        # policy gathered for generation under ZeRO-3 (its ep share of the routed experts;
        # not when it gathers per token: ZeRO-3's live parameters, counted already), and the
        # KV cache of one generate call's sequences.
        w = 2 if layout.precision != "fp32" else 4
        n = params_per_rank(shape, layout.tp)
        shard = n // layout.dp if layout.zero_stage == 3 else n
        reference = w * shard if grpo.kl_coef > 0 else 0
        policy = params_per_rank(shape, layout.tp, layout.ep)
        gathered = w * (policy - shard) if whole and layout.zero_stage == 3 else 0
        # tp splits the heads' keys and values. A latent cache (deepseek_v3) is counted split
        # too, which undercounts it by tp where tp > 1: AutoTP on latent attention is not
        # tried yet (docs/limits.md).
        kv_width = shape.kv_cache_width // layout.tp
        kv = shape.num_layers * generation_batch(grpo, layout.dp) * layout.seq_len * kv_width * w
        return reference + gathered + kv

    return [
        Demand(stage="pretrain", seq_len=seq, global_batch=batch),
        Demand(
            stage="grpo",
            expert_parallel=grpo.rollout == "flat",
            search_ep=False,
            seq_len=grpo.max_prompt_len + grpo.max_new_tokens,
            global_batch=grpo.prompts_per_step * grpo.group_size,
            group=grpo.group_size,
            extra_bytes=grpo_extra,
            per_token_extra_bytes=partial(grpo_extra, whole=False),
        ),
    ]


def _fill_from_table(
    fixed: Fixed,
    parallelism: ParallelismSettings,
    init_from: str | None,
    devices: Devices,
    fits: Callable[[TableEntry], str | None],
) -> tuple[Fixed, TableRecord]:
    """`fixed` with the table's values where the config left them open, and the table's
    record for plan.json. `fits` names why an entry does not fit, or None."""
    if all(getattr(fixed, k) is not None for k in tables.ENTRY_KEYS):
        return fixed, {
            "status": "not needed",
            "reason": "dp, tp and micro_batch_size set in the config",
        }
    entry, record = table_values(parallelism, init_from, devices, fits)
    return (fixed if entry is None else fixed.under(entry)), record


def _plan_source(sources: Mapping[str, str], table_record: TableRecord) -> str:
    """plan.json's `source`: config when the config set every searched value (ep aside where
    the model left nothing to choose), the table's source when it was used, else estimated."""
    labels = set(sources.values()) - {"model"}
    return (
        "config" if len(sources) == len(SEARCHED) and labels == {"config"}
        else table_record["source"] if table_record.get("status") == "used"
        else "estimated"
    )  # fmt: skip


def _shapes(
    model: ModelSettings, vocab_size: int, kept: Path | None
) -> Callable[[int], ModelShape]:
    """The model's shape for a given tp (the padded vocabulary depends on tp), each built once,
    and kept in the folder `kept` across runs when given (`shape.cached_shape`)."""

    def count(tp: int) -> ModelShape:
        from stagetrain.model.config import build_config, padded_vocab  # imports transformers

        return model_shape(build_config(model, padded_vocab(vocab_size, model.vocab_multiple, tp)))

    @cache
    def shape(tp: int) -> ModelShape:
        if kept is None:
            return count(tp)
        return cached_shape(kept, shape_key(model, vocab_size, tp), partial(count, tp))

    return shape


def resolve(
    hardware: HardwareReport, settings: PlannerSettings, *, shapes: Path | None = None
) -> PlanRecord:
    """Build plan.json from hardware.json and the planner's config sections.

    Of `settings.grpo` the planner reads only the keys that shape its batch
    (prompts_per_step, group_size, max_prompt_len, max_new_tokens, kl_coef). `shapes`: a
    folder that keeps the model's counted shapes across runs.
    """
    devices = devices_from(hardware, settings.hardware)
    speed = hardware.get("speed")
    choice = precisions.choose(settings.deepspeed.precision, devices.gpu, speed)
    precision = choice.precision
    kernel = attentions.choose(settings.deepspeed.attention, gpu=devices.gpu is not None,
                               speed=speed, precision=precision)  # fmt: skip
    rates = device_rates(devices, speed, precision, kernel.attention, settings.parallelism)
    shape = _shapes(settings.model, settings.tokenizer.vocab_size, shapes)
    configured = Fixed.of(settings.parallelism)
    heads, kv_heads = shape(1).num_heads, shape(1).num_kv_heads
    check_fixed(configured, devices, shape(1))
    stage_demands = demands(settings.pretrain, settings.grpo, devices)
    fits = partial(entry_misfit, fixed=configured, devices=devices, heads=heads,
                   kv_heads=kv_heads, stages=stage_demands)  # fmt: skip
    fixed, table_record = _fill_from_table(
        configured, settings.parallelism, settings.model.init_from, devices, fits
    )
    sources = {k: "config" for k in configured.given()}
    sources |= {k: table_record["source"] for k in fixed.given() if k not in sources}
    if "ep" not in sources and expert_parallel_refusal(shape(1).model_type):
        sources["ep"] = "model"  # nothing to choose: the architecture has no expert parallelism
    knobs = Knobs(parallelism=settings.parallelism, deepspeed=settings.deepspeed)
    stages: dict[str, StagePlanRecord] = {}
    find = partial(search, devices=devices, fixed=fixed, shape=shape, precision=precision,
                   knobs=knobs, rates=rates)  # fmt: skip
    for demand in stage_demands:
        found, gather = _gathered_or_per_token(demand, find, settings.grpo.rollout)
        entry: StagePlanRecord = {
            **found,
            "sources": {k: sources.get(k, "planner") for k in SEARCHED},
        }
        if demand.stage == "grpo":
            batch = generation_batch(settings.grpo, entry["layout"]["dp"])
            entry["generation"] = {"batch": batch, "gather": gather}
        stages[demand.stage] = entry
    model = {**asdict(shape(1)), "vocab_multiple": settings.model.vocab_multiple}
    return {
        "source": _plan_source(sources, table_record),
        "device": devices.gpu.key if devices.gpu else "cpu",
        "backend": "nccl" if devices.gpu else "gloo",
        "nodes": devices.nodes,
        "ranks_per_node": devices.per_node,
        "world": devices.world,
        "precision": precision,
        "precision_reason": choice.reason,
        "attention": kernel.attention,
        "attention_reason": kernel.reason,
        "model": cast(ModelRecord, model),  # ModelRecord names ModelShape's fields
        "table": table_record,
        "stages": stages,
        "warnings": [*choice.warnings, *(w for s in stages.values() for w in s["warnings"])],
    }


def _gathered_or_per_token(
    demand: Demand, find: Callable[[Demand], StageSearch], rollout: str
) -> tuple[StageSearch, Literal["whole", "per_token"]]:
    """The stage's search, and how its generation gathers ZeRO-3's partitions: the whole policy
    at once where a layout fits that copy, else, for GRPO, per token where a layout fits without
    it (TRL's `ds3_gather_for_generation=False`), with a warning of its cost.

    Raises:
        StageError: nothing fits either way (the error of the whole copy's search), or only per
            token under tree rollouts, whose ranks make different numbers of generate calls.
    """
    per_token = demand.per_token_extra_bytes
    try:
        found, failed = find(demand), None
    except StageError as err:
        if per_token is None:
            raise
        found, failed = None, err
    if found is not None and (per_token is None or found["candidates"]["fit"]):
        return found, "whole"
    assert per_token is not None  # without it `found` was returned, or the error raised
    try:
        lean = find(replace(demand, extra_bytes=per_token))
    except StageError:
        lean = None
    if lean is None or not lean["candidates"]["fit"]:
        if failed is not None:
            raise failed
        return cast(StageSearch, found), "whole"
    if rollout == "tree":
        raise StageError(
            "grpo.rollout: tree rollouts need the whole policy gathered for generation (their "
            "ranks make different numbers of generate calls), and no layout fits that copy; use "
            "rollout: flat, which gathers per token instead, or more or larger devices"
        )
    lean["warnings"].append(
        "grpo: no layout fits the whole policy gathered for generation under ZeRO-3; generation "
        "gathers each layer at every forward instead, the ranks in lockstep (an all-gather of the "
        "model per generated token instead of one per step: slower, by more with more layers)"
    )
    return lean, "per_token"


def plan_from(
    hardware: HardwareReport,
    sections: Mapping[str, Mapping[str, Any]],
    *,
    shapes: Path | None = None,
) -> PlanRecord:
    """`resolve` with the validated config sections by name, as the planner's rule passes them
    (the planner's job and the plan worked out at DAG time, `planning.ahead`, both call this),
    or a whole validated config: the typed sections are built here, once."""
    return resolve(hardware, PlannerSettings.from_config(sections), shapes=shapes)
