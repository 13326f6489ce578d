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

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, NotRequired, Self, TypedDict

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
        # mypy holds a class to Hashable by its instances' __hash__; a class is hashable
        hints = _hints(cls)  # type: ignore[arg-type]
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
    architecture: Literal["llama", "mixtral", "qwen2_moe", "deepseek_v3"] | None
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
    num_shared_experts: int | None = None
    first_dense_layers: int | None = None
    router_aux_loss_coef: float | None = None
    router_bias_update_rate: float | None = None


@dataclass(frozen=True)
class TokenizerSettings(_Section):
    source: Literal["train", "pretrained"]
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
    level_weights: tuple[float, ...] | None
    """Relative shares of levels 1..max_level; None draws them equally."""

    def __post_init__(self) -> None:
        key = "data.generated.level_weights"
        if self.level_weights is None:
            return
        if len(self.level_weights) != self.max_level:
            raise StageError(
                f"{key}: expected one weight per level 1..max_level {self.max_level}, "
                f"got {len(self.level_weights)}"
            )
        if not any(w > 0 for w in self.level_weights):
            raise StageError(
                f"{key}: expected at least one weight above 0, got {list(self.level_weights)}"
            )


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


def check_repo_path(key: str, path: str) -> None:
    """A file named in a hub repo is a relative path inside it: '..', an absolute path or a
    backslash reached huggingface_hub's own checks as a traceback."""
    if "\\" in path or any(part in ("", ".", "..") for part in path.split("/")):
        raise StageError(f"{key}: {path!r} is not a file of the repo (expected a relative path like "
                         "data/train.jsonl, without '.', '..' or empty parts)")  # fmt: skip


@dataclass(frozen=True)
class DataSettings(_Section):
    train_tokens: int
    val_tokens: int
    generated: GeneratedData
    files: tuple[FileData, ...]
    hub: tuple[HubData, ...]

    def __post_init__(self) -> None:
        for i, source in enumerate(self.hub):
            for j, path in enumerate(source.files):
                check_repo_path(f"data.hub.{i}.files.{j}", path)


class RewardSpec(TypedDict):
    """One tasks.families.N.rewards entry: a built-in verifier or a function of the user's
    ('path/file.py:name' or 'package.module:name'; with `kwargs`, a factory of the reward),
    exactly one of them (`workflow.checks.check_rewards`), weighted."""

    verifier: NotRequired[Literal["exact", "numeric", "format", "math"]]
    function: NotRequired[str]
    kwargs: dict[str, Any] | None
    weight: float


class HubTaskFile(TypedDict):
    """One hub dataset file of a task family (a local one is a path or glob string)."""

    repo: str
    file: str
    revision: NotRequired[str]


@dataclass(frozen=True)
class TaskColumns(_Section):
    prompt: str
    answer: str
    level: str | None
    solution: str | None


@dataclass(frozen=True)
class TaskFamilySettings(_Section):
    """One tasks.families entry: a generator, or files (local paths or globs as strings, hub
    files as `HubTaskFile` mappings); rewards stay mappings (`RewardSpec`), one verifier or function each."""

    name: str
    columns: TaskColumns
    level_edges: tuple[float, ...] | None
    rewards: tuple[RewardSpec, ...] | None
    success_at: float | None
    generator: Literal["arithmetic", "counting", "comparison"] | None = None
    files: tuple[str | HubTaskFile, ...] = ()

    def check_success_at(self, key: str, default: float) -> None:
        """The family's `success_at` can be reached and cannot be reached by nothing: a bar that
        every completion clears (every weight 0) scores an untrained model 1.0, and a bar above
        the largest reward its verifiers can give (each scores at most 1) solves nothing, so the
        curriculum never moves. A user function's range is unknown until it runs, so a family
        with one is not bounded here."""
        bar, where = (
            (default, "tasks.success_at") if self.success_at is None else (self.success_at, f"{key}.success_at")
        )  # fmt: skip
        rewards = self.rewards or ()
        if rewards and all(r["weight"] == 0 for r in rewards):
            raise StageError(
                f"{key}.rewards: every weight is 0, so every completion scores 0 and {where} means nothing; give a term a weight"
            )
        if all("verifier" in r for r in rewards):
            reachable = sum(max(r["weight"], 0.0) for r in rewards) if rewards else 1.0
            if bar > reachable + 1e-9:
                raise StageError(
                    f"{where}: {bar:g} is above family {self.name!r}'s largest reward, {reachable:g} "
                    "(its positive verifier weights summed, each verifier scoring at most 1): nothing could be solved"
                )


@dataclass(frozen=True)
class TasksSettings(_Section):
    families: tuple[TaskFamilySettings, ...]
    chat_template: bool
    success_at: float
    max_rows: int


@dataclass(frozen=True)
class HardwareSettings(_Section):
    source: Literal["detect", "describe"]
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
    ep: int | None
    micro_batch_size: int | None
    zero_stage: int | None
    activation_checkpointing: bool | None
    offload: Literal["none", "optimizer", "optimizer_and_params"] | None
    table_path: str | None
    table_repo: str | None
    table_revision: str
    on_table_miss: Literal["planner", "error"]
    max_micro_batch_size: int
    assumed_mfu: float
    cpu_efficiency: float
    reserved_gib: float
    fragmentation: float


@dataclass(frozen=True)
class DeepSpeedSettings(_Section):
    precision: Literal["auto", "bf16", "fp16", "fp32"]
    attention: Literal["auto", "sdpa", "eager"]
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
    schedule: Literal["cosine", "linear", "constant"]
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: float


@dataclass(frozen=True)
class PretrainSettings(_Section):
    seq_len: int
    global_batch_size: int
    global_batch_unit: Literal["sequences", "tokens"]
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
    """`grpo.curriculum`: which families, where each starts and how far it may climb, and what
    moves a family's level (its rolling success rate); the curriculum (`grpo.curriculum`)
    reads it as it is, and its keys' agreement is checked as it is built."""

    families: tuple[str, ...]
    start_level: int
    max_level: int
    window: int
    """Current-level prompts in the rolling success window."""
    promote_at: float
    """Success rate at or above which the level goes up."""
    demote_below: float
    """Success rate at or below which the level goes down."""
    min_steps: int
    """Optimizer steps at a level before it may change."""
    earlier_share: float
    """Share of prompts drawn from earlier levels."""

    def __post_init__(self) -> None:
        key = "grpo.curriculum"
        if self.start_level < 1:
            raise StageError(f"{key}.start_level: must be >= 1 (got {self.start_level})")
        if self.max_level < self.start_level:
            raise StageError(
                f"{key}.max_level: must be >= start_level {self.start_level} (got {self.max_level})"
            )
        for name in ("window", "min_steps"):
            if getattr(self, name) < 1:
                raise StageError(f"{key}.{name}: must be >= 1 (got {getattr(self, name)})")
        for name in ("promote_at", "demote_below", "earlier_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise StageError(f"{key}.{name}: must be in [0, 1] (got {getattr(self, name)})")
        if self.demote_below >= self.promote_at:
            raise StageError(
                f"{key}.demote_below: must be < promote_at {self.promote_at} (got {self.demote_below})"
            )


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
    router_aux_loss_coef: float
    steps: int
    optimizer: OptimizerSettings
    rollout: Literal["flat", "tree"]
    temperature: float
    top_p: float
    sampler_correction: SamplerCorrectionSettings | None
    tree: TreeSettings
    loss_type: Literal["grpo", "dapo", "dr_grpo"]
    clip_eps_low: float
    clip_eps_high: float
    passes: int
    curriculum: CurriculumSettings
    replay: ReplaySettings
    eval_problems: int
    eval_every: int
    eval_batches: int
    log_every: int
    log_completions_every: int
    checkpoint_every: int
    keep_checkpoints: int

    @property
    def optimizer_steps(self) -> int:
        """`passes` optimizer steps on each step's rollouts: what DeepSpeed's scheduler and Slurm count."""
        return self.steps * self.passes


@dataclass(frozen=True)
class MlflowSettings(_Section):
    tracking_uri: str | None
    experiment: str


@dataclass(frozen=True)
class TrackingSettings(_Section):
    report_to: tuple[Literal["tensorboard", "wandb", "mlflow"], ...]
    wandb_project: str
    mlflow: MlflowSettings


@dataclass(frozen=True)
class ConsolidateSettings(_Section):
    dtype: Literal["bf16", "fp32"]
    max_shard_size: str
    verify: Literal["loss", "finite"]


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
    license: str | None


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

    def training(self, stage: str) -> TrainingSettings:
        """The section of training stage `stage` (pretrain or grpo)."""
        if stage not in ("pretrain", "grpo"):
            raise StageError(f"unknown training stage {stage!r} (expected pretrain or grpo)")
        return self.pretrain if stage == "pretrain" else self.grpo
