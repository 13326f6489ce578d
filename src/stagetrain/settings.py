"""The validated config as frozen, typed sections: one dataclass per schema section.

`config.validate` fills every default; `Settings.from_config` (or one section's
`from_config`) turns the result into these objects once, so stage code reads
`grpo.clip_eps_low` instead of `cfg["grpo"]["clip_eps_low"]`, a misspelt key is
an attribute error at the first read instead of a KeyError deep in a loop, and
values derived from several keys (a stage's optimizer steps, GRPO's sequence
length) are computed in one place. Field names are the schema's keys;
tests/test_settings.py holds the two equal, section by section and nested
section by nested section, so a key added to one and not the other fails.

Lists become tuples, so a section cannot be changed once built. The raw dicts
stay where their exact JSON matters (checkpoint fingerprints, job specs).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Self

from stagetrain.errors import StageError


@dataclass(frozen=True)
class _Section:
    """A config section built from its validated mapping."""

    @classmethod
    def from_config(cls, values: Mapping[str, Any], where: str = "") -> Self:
        """Build from a validated section (defaults filled), nested sections and lists included.

        Raises:
            StageError: a key the dataclass does not know, or a required one missing
                (a section that did not go through `config.validate`).
        """
        if not isinstance(values, Mapping):
            raise StageError(
                f"config: {where or '<top level>'}: expected a mapping, got {values!r}"
            )
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise StageError(
                f"config: {_key(where, unknown[0])}: unknown key (allowed: {', '.join(known)})"
            )
        missing = [name for name, f in known.items() if name not in values and _required(f)]
        if missing:
            raise StageError(
                f"config: {_key(where, missing[0])}: required key missing (not validated?)"
            )
        hints = _hints(cls)
        return cls(**{k: _convert(hints[k], v, _key(where, k)) for k, v in values.items()})


def _key(where: str, key: object) -> str:
    return f"{where}.{key}" if where else str(key)


def _required(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(hint: Any, value: Any, where: str) -> Any:
    """`value` as the field's type: a nested section built, a list made a tuple."""
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, _Section):
        return hint.from_config(value, where)
    if origin in (typing.Union, types.UnionType) and value is not None:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, where)
        return value  # str | Mapping (a task file): kept as given
    if origin is tuple and isinstance(value, list | tuple):
        item = typing.get_args(hint)[0]
        return tuple(_convert(item, v, _key(where, i)) for i, v in enumerate(value))
    return value


@dataclass(frozen=True)
class RunSettings(_Section):
    name: str
    seed: int


@dataclass(frozen=True)
class ModelSettings(_Section):
    """The model: a shape from scratch, or `init_from` (then the shape keys are absent: None)."""

    init_from: str | None
    architecture: str | None
    resize_embeddings: bool
    vocab_multiple: int
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool | None = None
    num_experts: int | None = None
    experts_per_token: int | None = None
    moe_intermediate_size: int | None = None
    router_aux_loss_coef: float | None = None


@dataclass(frozen=True)
class TokenizerSettings(_Section):
    source: str
    path: str | None
    vocab_size: int
    training_sample_mb: float
    add_special_tokens: bool
    pad_token: str | None
    trust_remote_code: bool


@dataclass(frozen=True)
class GeneratedData(_Section):
    weight: float
    families: tuple[str, ...]
    max_level: int
    prose_share: float


@dataclass(frozen=True)
class FileData(_Section):
    path: str
    weight: float
    text_field: str


@dataclass(frozen=True)
class HubData(_Section):
    repo: str
    files: tuple[str, ...]
    revision: str
    weight: float
    text_field: str


@dataclass(frozen=True)
class DataSettings(_Section):
    train_tokens: int
    val_tokens: int
    generated: GeneratedData
    files: tuple[FileData, ...]
    hub: tuple[HubData, ...]


@dataclass(frozen=True)
class TaskColumns(_Section):
    prompt: str
    answer: str
    level: str | None
    solution: str | None


@dataclass(frozen=True)
class TaskFamilySettings(_Section):
    """One tasks.families entry: a generator, or files (local paths or globs as strings, hub
    files as {repo, file, revision} mappings); rewards stay mappings, one verifier or function each."""

    name: str
    columns: TaskColumns
    level_edges: tuple[float, ...] | None
    rewards: tuple[Mapping[str, Any], ...] | None
    success_at: float | None
    generator: str | None = None
    files: tuple[str | Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class TasksSettings(_Section):
    families: tuple[TaskFamilySettings, ...]
    chat_template: bool
    success_at: float


@dataclass(frozen=True)
class HardwareSettings(_Section):
    source: str
    gpu: str | None
    gpus_per_node: int | None
    host_memory_gib: float | None
    nodes: int
    cpu_ranks: int
    inter_node_gbps: float


@dataclass(frozen=True)
class ParallelismSettings(_Section):
    """Fixed layout values (None: the table or the planner chooses) and the planner's knobs."""

    dp: int | None
    tp: int | None
    micro_batch_size: int | None
    zero_stage: int | None
    activation_checkpointing: bool | None
    offload: str | None
    table_path: str | None
    table_repo: str | None
    table_revision: str
    on_table_miss: str
    max_micro_batch_size: int
    assumed_mfu: float
    cpu_efficiency: float
    reserved_gib: float
    fragmentation: float


@dataclass(frozen=True)
class DeepSpeedSettings(_Section):
    precision: str
    attention: str
    overlap_comm: bool
    bucket_size: int
    stage3_max_live_parameters: int
    fp16_initial_scale_power: int


@dataclass(frozen=True)
class OptimizerSettings(_Section):
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    schedule: str
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: float


@dataclass(frozen=True)
class PretrainSettings(_Section):
    seq_len: int
    global_batch_size: int
    global_batch_unit: str
    steps: int
    optimizer: OptimizerSettings
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int

    @property
    def optimizer_steps(self) -> int:
        """One optimizer step per training step."""
        return self.steps


@dataclass(frozen=True)
class SamplerCorrectionSettings(_Section):
    cap: float


@dataclass(frozen=True)
class TreeSettings(_Section):
    branching: int
    segment_tokens: int
    uct_c: float
    probe_leaves: int
    branch_entropy: float
    prefix_cache: bool


@dataclass(frozen=True)
class CurriculumSettings(_Section):
    families: tuple[str, ...]
    start_level: int
    max_level: int
    window: int
    promote_at: float
    demote_below: float
    min_steps: int
    earlier_share: float


@dataclass(frozen=True)
class ReplaySettings(_Section):
    share: float
    families: tuple[str, ...] | None


@dataclass(frozen=True)
class GrpoSettings(_Section):
    prompts_per_step: int
    group_size: int
    max_prompt_len: int
    max_new_tokens: int
    kl_coef: float
    steps: int
    optimizer: OptimizerSettings
    rollout: str
    temperature: float
    top_p: float
    sampler_correction: SamplerCorrectionSettings | None
    tree: TreeSettings
    loss_type: str
    clip_eps_low: float
    clip_eps_high: float
    passes: int
    curriculum: CurriculumSettings
    replay: ReplaySettings
    eval_problems: int
    eval_every: int
    eval_batches: int
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int

    @property
    def optimizer_steps(self) -> int:
        """`passes` optimizer steps on each step's rollouts: what DeepSpeed's scheduler and Slurm count."""
        return self.steps * self.passes


@dataclass(frozen=True)
class TrackingSettings(_Section):
    report_to: tuple[str, ...]
    wandb_project: str


@dataclass(frozen=True)
class ConsolidateSettings(_Section):
    dtype: str
    max_shard_size: str
    verify: str


@dataclass(frozen=True)
class EvaluateSettings(_Section):
    problems: int
    levels: tuple[int, ...]
    tasks: tuple[str, ...]
    batch_size: int


@dataclass(frozen=True)
class PublishSettings(_Section):
    repo: str | None
    revision: str
    private: bool


TrainingSettings = PretrainSettings | GrpoSettings


def training_settings(stage: str, section: Mapping[str, Any]) -> TrainingSettings:
    """The validated section of training stage `stage` (pretrain or grpo), typed."""
    kinds: dict[str, type[PretrainSettings] | type[GrpoSettings]] = {
        "pretrain": PretrainSettings,
        "grpo": GrpoSettings,
    }
    if stage not in kinds:
        raise StageError(f"unknown training stage {stage!r} (expected pretrain or grpo)")
    return kinds[stage].from_config(section, stage)


@dataclass(frozen=True)
class Settings(_Section):
    """The whole validated config, one typed section per schema section."""

    run: RunSettings
    model: ModelSettings
    tokenizer: TokenizerSettings
    data: DataSettings
    tasks: TasksSettings
    hardware: HardwareSettings
    parallelism: ParallelismSettings
    deepspeed: DeepSpeedSettings
    pretrain: PretrainSettings
    grpo: GrpoSettings
    tracking: TrackingSettings
    consolidate: ConsolidateSettings
    evaluate: EvaluateSettings
    publish: PublishSettings
