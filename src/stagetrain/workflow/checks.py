"""The checks no schema can make, run once when the DAG is built: keys that must agree with
each other, and keys whose valid values the domain modules know (family names, reward
functions, task file suffixes, the tree's budget, what AutoEP can split).

The settings (`config.settings`) are pure data built from the validated config; these checks
need the planner, the model architectures, the task registry and the tree search, which sit
above the config, so they live here at the workflow's door: `common.smk` runs them on the
whole config before any rule, and a stage script run on its own (`workflow.stage`) runs them
on its config file. A bad combination thus fails `snakemake -n` with one line, not a stage.
"""

from __future__ import annotations

import dataclasses

from stagetrain.config.settings import (
    GrpoSettings,
    Settings,
    TaskFamilySettings,
    TasksSettings,
    TrainingSettings,
    check_repo_path,
)
from stagetrain.errors import StageError
from stagetrain.grpo.tree import TreeConfig
from stagetrain.model.architectures import AUX_LOSS, expert_parallel_refusal
from stagetrain.planning.plan import factor_misfit, parallelism_error
from stagetrain.tasks.files import SUFFIXES, suffix_of
from stagetrain.tasks.registry import FAMILIES
from stagetrain.tasks.rewards import parse_function


def check(settings: Settings, *, source: str = "config") -> None:
    """Every check across keys of the whole config, each failure one line naming the key
    (prefixed by `source`, as the schema's are).

    Raises:
        StageError: the first key that does not agree with the others.
    """
    try:
        check_tasks(settings.tasks)
        _check_family_names(settings)
        check_grpo(settings.grpo)
        for name, stage in (("pretrain", settings.pretrain), ("grpo", settings.grpo)):
            _check_warmup(name, stage)
        _check_positions(settings)
        _check_grpo_aux_loss(settings)
        _check_expert_parallel(settings)
    except StageError as err:
        raise StageError(f"{source}: {err}") from None


def _check_expert_parallel(s: Settings) -> None:
    """parallelism.ep > 1 needs an architecture AutoEP splits, tp 1 and ZeRO 1-3 (the rest,
    dividing dp and the experts, the planner checks against the devices and the model; a
    model continued with `init_from` may name no architecture here, and the planner checks
    its config then)."""
    ep, tp = s.parallelism.ep or 1, s.parallelism.tp or 1
    if ep == 1:
        return
    arch, dp = s.model.architecture, s.parallelism.dp
    refusal = expert_parallel_refusal(arch) if arch is not None else None
    if refusal:
        raise parallelism_error("ep", f"{refusal} (model.architecture)")
    world = (dp or ep) * tp  # the world these fixed values imply, enough to check them
    problem = factor_misfit(world=world, per_node=world, dp=dp, tp=tp, ep=ep, heads=None,
                            kv_heads=None, zero_stage=s.parallelism.zero_stage)  # fmt: skip
    if problem:
        raise parallelism_error(problem[0], f"{problem[1]} (dp={dp}, tp={tp}, ep={ep})")


def _check_grpo_aux_loss(s: Settings) -> None:
    """grpo.router_aux_loss_coef needs an architecture with an aux loss; a model continued
    with `init_from` may name none here, and the GRPO stage checks its config then."""
    arch = s.model.architecture
    if s.grpo.router_aux_loss_coef and arch is not None and arch not in AUX_LOSS:
        raise StageError(
            f"grpo.router_aux_loss_coef: model.architecture {arch} defines no load-balancing "
            f"loss (only {' and '.join(AUX_LOSS)} do); expected 0"
        )


def _check_family_names(s: Settings) -> None:
    """The families the corpus, the curriculum and replay name exist (built-in, or of the
    tasks section), once each; replay names none of the curriculum's."""
    known = list(dict.fromkeys([*FAMILIES, *(f.name for f in s.tasks.families)]))
    curriculum = s.grpo.curriculum.families
    for key, names in (("data.generated.families", s.data.generated.families),
                       ("grpo.curriculum.families", curriculum),
                       ("grpo.replay.families", s.grpo.replay.families or ())):  # fmt: skip
        for i, name in enumerate(names):
            if name in names[:i]:
                raise StageError(f"{key}: {name!r} is listed twice")
            if name not in known:
                raise StageError(f"{key}: unknown family {name!r} (known: {', '.join(known)}; "
                                 "your own go in tasks.families)")  # fmt: skip
            if key == "grpo.replay.families" and name in curriculum:
                raise StageError(
                    f"{key}: {name!r} is in grpo.curriculum.families; replay is for the others"
                )
    replay = s.grpo.replay
    corpus = s.data.generated.families if s.data.generated.weight > 0 else ()
    if replay.share and replay.families is None and set(corpus) <= set(curriculum):
        raise StageError("grpo.replay.share: > 0, but no family to replay: the corpus teaches none the curriculum "
                         "leaves out (name them in grpo.replay.families, or set the share to 0)")  # fmt: skip
    own = {f.name for f in s.tasks.families}
    builtin = [n for n in (*s.data.generated.families, *curriculum, *(s.grpo.replay.families or ()))
               if n in FAMILIES and n not in own]  # fmt: skip
    if builtin and s.tasks.success_at > 1:  # scored by their own verifier, at most 1
        raise StageError(
            f"tasks.success_at: {s.tasks.success_at:g} is above family {builtin[0]!r}'s largest reward, 1 "
            "(its own verifier, scoring at most 1): nothing could be solved; set the bar on your own families "
            "instead (tasks.families[].success_at)"
        )


def _check_positions(s: Settings) -> None:
    """Sequences no longer than the model's positions (from scratch; an init_from model's
    are known only once its config is read): transformers accepted longer ones silently."""
    limit = s.model.max_position_embeddings
    if s.model.init_from or limit is None:
        return
    grpo = s.grpo
    for key, length in (("pretrain.seq_len", s.pretrain.seq_len),
                        ("grpo.max_prompt_len + grpo.max_new_tokens", grpo.max_prompt_len + grpo.max_new_tokens)):  # fmt: skip
        if length > limit:
            raise StageError(
                f"{key}: {length} tokens, more than model.max_position_embeddings ({limit})"
            )


def _check_warmup(name: str, stage: TrainingSettings) -> None:
    """A stage's warmup within its optimizer steps: DeepSpeed's schedule only logs a warning
    and the learning rate never reaches the configured one."""
    steps, warmup = stage.optimizer_steps, stage.optimizer.warmup_steps
    if warmup > steps:
        counted = f"{name}.steps" if name == "pretrain" else "grpo.steps x grpo.passes"
        raise StageError(
            f"{name}.optimizer.warmup_steps: expected at most the stage's {steps} "
            f"optimizer steps ({counted}), got {warmup}"
        )


def check_tasks(tasks: TasksSettings) -> None:
    """Each family is one kind (a generator, or files), its name its own, and each reward
    one verifier or one function."""
    seen: set[str] = set()
    for i, family in enumerate(tasks.families):
        key, name = f"tasks.families.{i}", family.name
        if name in seen:
            raise StageError(f"{key}.name: {name!r} is listed twice")
        seen.add(name)
        if family.generator is not None:
            if name != family.generator:
                raise StageError(
                    f"{key}.name: a generator family is named after its generator ({family.generator!r}), not {name!r}"
                )
            extra = [k for k in ("files", "level_edges") if getattr(family, k)]
            if extra:
                raise StageError(
                    f"{key}.{extra[0]}: a generator family ({family.generator}) reads no files"
                )
        elif not family.files:
            raise StageError(
                f"{key}: expected files (your problems) or generator (a built-in family)"
            )
        elif name in FAMILIES:
            raise StageError(
                f"{key}.name: {name!r} is a built-in family's name; name your family otherwise"
            )
        for j, entry in enumerate(family.files):
            name = entry if isinstance(entry, str) else entry["file"]
            where = f"{key}.files.{j}" + ("" if isinstance(entry, str) else ".file")
            if not isinstance(entry, str):
                check_repo_path(where, name)
            if suffix_of(name) is None and not (
                isinstance(entry, str) and any(c in name for c in "*?[")
            ):
                raise StageError(
                    f"{where}: {name!r} is not a task file; expected one of {', '.join(SUFFIXES)}"
                )
        check_rewards(family, key)
        family.check_success_at(key, tasks.success_at)


def check_rewards(family: TaskFamilySettings, key: str) -> None:
    """Each reward is one verifier or one function, and a function's `module:name` parses."""
    for j, reward in enumerate(family.rewards or ()):
        kinds = [k for k in ("verifier", "function") if k in reward]
        if len(kinds) != 1:
            raise StageError(f"{key}.rewards.{j}: expected exactly one of verifier or function")
        if "function" in reward:
            parse_function(reward["function"], f"{key}.rewards.{j}.function")
        elif reward.get("kwargs") is not None:
            raise StageError(
                f"{key}.rewards.{j}.kwargs: only a function takes kwargs (a factory's arguments)"
            )


def check_grpo(grpo: GrpoSettings) -> None:
    """The tree's keys against the group's, checked by the class the stage builds (so at
    DAG time, not 140 s into the GRPO ranks after pretraining has run); the curriculum's
    are checked as it is built."""
    if grpo.rollout == "tree":
        TreeConfig(**dataclasses.asdict(grpo.tree), max_leaves=grpo.group_size,
                   max_tokens=grpo.group_size * grpo.max_new_tokens,
                   max_new_tokens=grpo.max_new_tokens, eos_id=0)  # fmt: skip
