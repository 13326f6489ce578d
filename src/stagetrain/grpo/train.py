"""The GRPO loop, run on every rank by torchrun: `python -m stagetrain.grpo.train --spec job.json`.

Per step: each data-parallel rank draws its share of the prompts from the
curriculum (a family, then a level from that family's own curriculum), rolls
them out (flat or tree) with the policy's KV-cached `generate` (under ZeRO-3
with the parameters gathered for the whole phase and released after it, as
TRL's ds3 gather does), scores them with each family's rewards (built-in
verifiers and the user's functions, `stagetrain.tasks.rewards`), and trains through the
DeepSpeed engine: `engine.backward` and `engine.step` for exactly the
configured accumulation steps, `passes` times. Outcomes are gathered from all
ranks so every rank updates the same per-family curriculum states.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple, TypedDict, cast

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from stagetrain.config.settings import CurriculumSettings, GrpoSettings, TasksSettings
from stagetrain.consolidate.manifest import Manifest
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.errors import StageError
from stagetrain.evaluate.heldout import GainReport, gains
from stagetrain.grpo import steps as grpo_steps
from stagetrain.grpo.completions import COMPLETION_RECORD, write_table
from stagetrain.grpo.curriculum import (
    Curriculum,
    CurriculumStateRecord,
    top_level,
)
from stagetrain.grpo.metrics import METRICS, GrpoRecord
from stagetrain.grpo.run import Replay, Run
from stagetrain.grpo.summary import GrpoSummary, SamplerSummary
from stagetrain.grpo.tree import TreeConfig
from stagetrain.io import atomic_write_text, read_json
from stagetrain.planning.plan import Layout
from stagetrain.tasks import Problem, get_family, heldout
from stagetrain.tasks.families import hub_pins, load_tasks, reward_digests
from stagetrain.tasks.judge import Judge
from stagetrain.training import engine as engines
from stagetrain.training.batches import window_count
from stagetrain.training.checkpoints import Checkpoints
from stagetrain.training.deepspeed_config import DeepSpeedJson
from stagetrain.training.engine import gathered
from stagetrain.training.evaluation import greedy_scores, in_lockstep, validation_loss
from stagetrain.training.experts import routing_of
from stagetrain.training.host import once_per_host
from stagetrain.training.loop import StageLoop, quiet_other_ranks
from stagetrain.training.metrics import Progress, check_finite
from stagetrain.training.rank import rank_main
from stagetrain.training.spec import GrpoJob

log = logging.getLogger("stagetrain")
PROMPT_RECORD = {
    "step": "GRPO steps completed",
    "prompts": "problem keys of the step, dp ranks in order",
    "prompt_ids": "the token ids each prompt was given as (chat template included), in the same order",
}
NOT_MATHS = (
    "eval_problems",
    "eval_every",
    "eval_batches",
    "log_every",
    "log_completions_every",
    "checkpoint_every",
    "keep_checkpoints",
)
NOT_MATHS_TREE = ("prefix_cache",)
"""grpo.tree keys that change how fast a tree is sampled, not what it samples (the cached and
uncached trees give the same tokens): toggling one resumes the checkpoint instead of retraining."""


class PromptRecord(TypedDict):
    """One record of the debug log prompts.jsonl (PROMPT_RECORD says what each key means)."""

    step: int
    prompts: list[str]
    prompt_ids: list[list[int]]


AccuracyRecord = TypedDict(
    "AccuracyRecord", {"eval/accuracy": float, "eval/accuracy_by_family": dict[str, float]}
)
"""The metrics of one held-out evaluation (`_accuracy_record`), part of a `GrpoRecord`."""


class Trained(NamedTuple):
    """What the loop leaves for the summary."""

    curriculum: dict[str, CurriculumStateRecord]
    """Every family's curriculum at the end."""
    optimizer_steps: int
    """DeepSpeed's count (steps x passes)."""
    final_accuracy: dict[str, float] | None
    """The held-out accuracy measured at the last step, by family; None when it trained none."""


def _reference(
    model_dir: str,
    ds_config: DeepSpeedJson,
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
) -> DeepSpeedEngine | PreTrainedModel:
    """The frozen reference policy: partitioned like the policy under ZeRO-3, a plain copy
    otherwise; with the policy's attention kernel. Without AutoEP, whatever the policy's ep:
    under ZeRO-3 its partitions already hold 1/dp of every expert, so AutoEP would save it no
    memory, and under ZeRO 0-2 it is a plain module, as without ep."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention)
    model.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        drop = ("optimizer", "scheduler", "expert_parallel")
        config = cast(DeepSpeedJson, {k: v for k, v in ds_config.items() if k not in drop})
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns None, not the engine as nn.Module's does
        return engine
    return model.to(device=device, dtype=dtype).eval()


def fingerprinted(grpo: Mapping[str, Any]) -> dict[str, Any]:
    """The grpo keys that decide what training computes: the checkpoint fingerprint's part, the
    section's JSON as the config gives it (what the fingerprint hashes), less NOT_MATHS."""
    out = {k: v for k, v in grpo.items() if k not in NOT_MATHS}
    if isinstance(out.get("tree"), dict):
        out["tree"] = {k: v for k, v in out["tree"].items() if k not in NOT_MATHS_TREE}
    return out


def setup(spec: GrpoJob) -> Run:
    """Process group, world check, policy engine (from the consolidated pretrain model), reference, data."""
    plan, meta, ds_config, device = engines.join_world(spec)
    cfg = GrpoSettings.from_config(spec["grpo"], "grpo")
    layout = Layout.from_plan(plan, "grpo")
    # The planner never makes this plan; one edited by hand could.
    if cfg.rollout == "tree" and layout.ep > 1:
        raise StageError(f"grpo.rollout: tree rollouts cannot run at ep={layout.ep} (their ranks make different "
                         "numbers of generate calls, and every forward is an all-to-all); plan GRPO at ep=1")  # fmt: skip
    tasks_settings = TasksSettings.from_config(spec["tasks"], "tasks")
    tasks = once_per_host(lambda: load_tasks(tasks_settings, pins=hub_pins(meta)), name="tasks")
    tasks.register()
    manifest: Manifest = read_json(Path(spec["model"]) / "MANIFEST.json")
    components = {  # the start model by content: a resharded folder of the same weights resumes
        "model": {"weights": manifest["weights_sha256"], "config": manifest["files"]["config.json"]["sha256"]},
        "tokenizer": meta["tokenizer_sha256"],
        "training": fingerprinted(spec["grpo"]),
        "tasks": {"config": spec["tasks"], "data": tasks.record(), "reward_code": reward_digests(tasks_settings)},
        "precision": layout.precision, "seed": spec["seed"],
    }  # fmt: skip
    checkpoints = Checkpoints(Path(spec["checkpoints"]), components,
                              layout.checkpoint_layout, cfg.keep_checkpoints)  # fmt: skip
    checkpoints.hold()  # before anything is built or written: a second run of the stage stops here
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    judge = Judge(tasks, tokenizer, max_prompt_len=cfg.max_prompt_len)
    replay = replay_of(cfg, meta)
    evaluated = evaluated_families(cfg.curriculum.families, meta)
    corpus = corpus_families(meta)
    top = {f: max(cfg.curriculum.max_level if f in cfg.curriculum.families else 1, corpus.get(f, 1))
           for f in [*evaluated, *sorted(replay.levels if replay else ())]}  # fmt: skip
    check_families(judge, top)  # before the engines are built
    config = engines.load_model_config(spec["model_config"])
    routing = routing_of(config)
    if cfg.router_aux_loss_coef and (routing is None or routing.coef is None):
        raise StageError(f"grpo.router_aux_loss_coef: the policy is a {config.model_type} model, which defines no "
                         "load-balancing loss (mixtral and qwen2_moe do); expected 0")  # fmt: skip
    engine, _, zero3_config = engines.build(
        config=config, ds_config=ds_config, init_from=spec["model"],
        activation_checkpointing=layout.activation_checkpointing, seed=spec["seed"],
        attention=plan["attention"],
    )  # fmt: skip
    dtype = next(engine.module.parameters()).dtype
    reference = None
    if cfg.kl_coef > 0:
        reference = _reference(spec["model"], ds_config, device, dtype, plan["attention"])
    curriculum = cfg.curriculum
    tree = None
    if cfg.rollout == "tree":
        tree = TreeConfig(**asdict(cfg.tree), max_leaves=cfg.group_size, max_tokens=cfg.group_size * cfg.max_new_tokens,
                          max_new_tokens=cfg.max_new_tokens, eos_id=tokenizer.eos_token_id)  # fmt: skip
    seq = layout.seq_len  # the plan's: max_prompt_len + max_new_tokens
    val = np.memmap(spec["val"], dtype=meta["dtype"], mode="r")
    eval_set = held_out_set(evaluated, curriculum, cfg.eval_problems, spec["seed"])
    return Run(
        spec=spec, cfg=cfg, engine=engine, reference=reference, tokenizer=tokenizer, judge=judge, device=device,
        layout=layout,
        dp_rank=dist.get_rank(group=engine.data_parallel_group), curriculum=curriculum, tree=tree, eval_set=eval_set,
        loop=StageLoop(stage="grpo", spec=spec, cfg=cfg, engine=engine, checkpoints=checkpoints),
        val=val, eval_windows=np.arange(min(window_count(len(val), seq), cfg.eval_batches * layout.micro_batch_size)),
        generation_batch=plan["stages"]["grpo"]["generation"]["batch"], replay=replay,
        gather_whole=plan["stages"]["grpo"]["generation"]["gather"] == "whole",
        zero3_config=zero3_config, routing=routing,
    )  # fmt: skip


def held_out_set(
    families: Sequence[str], curriculum: CurriculumSettings, n: int, seed: int
) -> list[Problem]:
    """The problems the stage's held-out evaluation scores before and after training: `n` of
    each evaluated family's test split (`tasks.heldout`) at the level the curriculum starts it
    at, so that the gain is measured where training began, on problems it never draws."""
    levels = {
        family: min(curriculum.start_level, top_level(curriculum, family)) for family in families
    }
    return [p for family in families for p in heldout(family, levels[family], n, seed)]


LENGTH_SAMPLES = 256
"""Problems drawn per level of a generated family to check grpo.max_prompt_len before any step:
a level's prompts vary in length only with the numbers and words drawn, so the longest is among
these in practice, and a rarer longer one is refused when drawn (`Prompter.ids`)."""


def check_families(judge: Judge, top: Mapping[str, int]) -> None:
    """Before any step: each family's reward functions import, and its prompts fit
    grpo.max_prompt_len as rendered (chat template included): every prompt of a file family,
    LENGTH_SAMPLES per level of a generated one up to `top[family]`, the highest level GRPO
    draws of it. The tokenizer is trained after the plan is made, so this is the first point
    where prompt lengths are known."""
    rng = random.Random(0)
    for family, level in top.items():
        judge.tasks.rewards(family)
        fam = get_family(family)
        if fam.pool is not None:
            judge.prompter.check_lengths([p for problems in fam.pool.values() for p in problems])
        else:
            generate = fam.generate
            assert generate is not None  # a family without a pool is generated
            judge.prompter.check_lengths([generate(rng, lv) for lv in range(1, min(level, fam.max_level) + 1)
                                          for _ in range(LENGTH_SAMPLES)])  # fmt: skip


def corpus_families(meta: TokenizerMeta) -> dict[str, int]:
    """{family: the highest level of it the pretraining corpus holds}, from data/meta.json's
    generated source (built-in families and the tasks section's, which are loaded by then)."""
    return {
        f: min(s["record"]["max_level"], get_family(f).max_level)
        for s in meta.get("sources", []) if s["record"]["kind"] == "generated"
        for f in s["record"]["families"]
    }  # fmt: skip


def evaluated_families(curriculum: Sequence[str], meta: TokenizerMeta) -> list[str]:
    """The families the held-out evaluation scores: the curriculum's, then every other family
    the pretraining corpus taught, so that what GRPO on some families costs the others is
    measured, not only what it gains."""
    return list(dict.fromkeys([*curriculum, *corpus_families(meta)]))


def replay_of(cfg: GrpoSettings, meta: TokenizerMeta) -> Replay | None:
    """`grpo.replay` resolved: its families (by default the corpus's that the curriculum leaves
    out) with the corpus's levels of each; None when it replays nothing."""
    if not cfg.replay.share:
        return None
    corpus = corpus_families(meta)
    families = cfg.replay.families
    if families is None:
        families = tuple(f for f in corpus if f not in cfg.curriculum.families)
    if not families:  # the names themselves were checked with the config
        raise StageError(
            "grpo.replay.share: > 0, but no family to replay (the curriculum has every corpus family)"
        )
    return Replay(cfg.replay.share, {f: corpus.get(f, 1) for f in families})


def accuracy(run: Run) -> dict[str, float]:
    """Greedy accuracy per family on the fixed held-out problems, every rank's.

    The problems go to `greedy_scores` in chunks of the generation batch, and the chunks are
    dealt round-robin over the data-parallel ranks (a tensor-parallel group shares its rank's),
    then gathered: each chunk is the same `generate` call whichever rank makes it, so the
    scores are those of one rank evaluating all of them, in 1/dp of the time."""
    size, dp = run.generation_batch, run.layout.dp
    chunks = [run.eval_set[at : at + size] for at in range(0, len(run.eval_set), size)]
    mine = chunks[run.dp_rank :: dp]  # the short last chunk, if any, stays last
    run.engine.eval()
    with gathered(run.engine, whole=run.gather_whole), torch.no_grad():
        # In lockstep each rank makes as many generate calls: a rank one chunk short (its
        # chunks all full) scores the first chunk again, and drops it.
        lockstep = in_lockstep(run.engine.module)
        spare = chunks[0] * (-(-len(chunks) // dp) - len(mine)) if lockstep else []
        scores = greedy_scores(run.engine.module, run.judge, [p for c in mine for p in c] + spare,
                               max_new_tokens=run.cfg.max_new_tokens, chunk_size=size)  # fmt: skip
    scores = scores[: len(scores) - len(spare)]
    run.engine.train()
    per_rank = grpo_steps.gather_dp(
        [[scores[i * size : (i + 1) * size] for i in range(len(mine))]], run.dp_rank
    )
    by_chunk = {
        r + i * dp: chunk for r, ranks in enumerate(per_rank) for i, chunk in enumerate(ranks)
    }
    correct = [c for k in sorted(by_chunk) for c in by_chunk[k]]
    families = sorted({p.family for p in run.eval_set})
    return {
        f: float(np.mean([c for c, p in zip(correct, run.eval_set, strict=True) if p.family == f]))
        for f in families
    }


def val_loss(run: Run) -> float:
    """Language-model loss on the fixed validation windows (what consolidation re-checks)."""
    run.engine.eval()
    loss = validation_loss(run.engine, run.val, run.eval_windows, seq_len=run.layout.seq_len,
                           micro_batch_size=run.layout.micro_batch_size, device=run.device)  # fmt: skip
    run.engine.train()
    return loss


def loop(run: Run) -> Trained:
    """Train from the latest checkpoint (or the pretrained model) to grpo.steps."""
    cfg, stage = run.cfg, run.loop
    curriculum = Curriculum.start(run.curriculum, cfg.curriculum.families)
    client = stage.resume(METRICS)
    if client is not None:
        try:
            curriculum = Curriculum.from_json(client["curriculum"])
        except StageError as err:
            raise StageError(f"{run.loop.checkpoints.folder}/{stage.resumed_tag}: {err}") from None
        log.info("curriculum levels at step %d: %s", stage.start, _levels(curriculum.levels()))
    run.eval_windows = stage.eval_set(run.eval_windows, client)
    prompts_log = stage.debug_log("prompts.jsonl", PROMPT_RECORD)  # pretrain's window log's twin
    table = stage.step_log("completions.jsonl", COMPLETION_RECORD)
    began, final, progress = time.monotonic(), None, Progress(cfg.steps, stage.start)
    if stage.start == 0 and stage.metrics:
        stage.metrics.write({"step": 0, **_accuracy_record(accuracy(run))})
    elif stage.start == 0:
        accuracy(run)
    for step in stage.steps():
        t0 = time.monotonic()
        stepped = grpo_steps.step(run, curriculum, step)
        record = stepped.record
        check_finite(record["train/loss"], what="training loss", stage="grpo", step=step,
                     precision=run.layout.precision)  # fmt: skip
        record["time/elapsed_s"] = time.monotonic() - began
        record["throughput/tokens_per_s"] = stepped.tokens / (time.monotonic() - t0)
        if prompts_log:
            prompts_log.write(
                {"step": step, "prompts": stepped.prompts, "prompt_ids": stepped.prompt_ids}
            )
        if table:
            for row in stepped.completions:
                table.write(row)
        if stage.evaluates(step):
            final = accuracy(run)
            record.update(_accuracy_record(final))
        if stage.metrics and (
            stage.logs(step) or "eval/accuracy" in record or "curriculum/events" in record
        ):
            stage.metrics.write(record)
            log.info("%s reward %.3f levels %s", progress.line(step, record["train/loss"], record["throughput/tokens_per_s"]),
                     record["reward/mean"], _levels(record["curriculum/level"]))  # fmt: skip
        stage.checkpoint(step, {"step": step, "curriculum": curriculum.to_json()})
    # the loop always evaluates its last step
    return Trained(curriculum.to_json(), run.engine.global_steps, final)


def _accuracy_record(by_family: dict[str, float]) -> AccuracyRecord:
    """The metrics of one held-out evaluation: the mean over families and each family's."""
    return {
        "eval/accuracy": float(np.mean(list(by_family.values()))),
        "eval/accuracy_by_family": by_family,
    }


def _levels(levels: dict[str, int]) -> str:
    """{family: level} for a log line: "arithmetic=1 comparison=2"."""
    return " ".join(f"{family}={level}" for family, level in levels.items())


def summarise(
    run: Run, done: Trained, final_accuracy: dict[str, float], loss: float
) -> GrpoSummary:
    """summary.json of the GRPO stage (the same checkpoint and evaluation keys as pretrain's)."""
    records = run.loop.records()
    trained = [r for r in records if "train/loss" in r]
    final_step = run.cfg.steps
    return {
        **run.loop.summary(final_eval_loss=loss, layout=run.layout),
        "optimizer_steps": done.optimizer_steps, "curriculum": done.curriculum,
        "losses": {r["step"]: r["train/loss"] for r in trained}, "final_loss": trained[-1]["train/loss"] if trained else None,
        "rewards": {r["step"]: r["reward/mean"] for r in trained},
        "reward_max": max((r["reward/max"] for r in trained), default=None),
        "levels": {r["step"]: r["curriculum/level"] for r in trained},
        "evaluations": {**{r["step"]: r["eval/accuracy_by_family"] for r in records if "eval/accuracy_by_family" in r},
                        final_step: final_accuracy},
        "accuracy": {"start": records[0].get("eval/accuracy"), "start_by_family": records[0].get("eval/accuracy_by_family"),
                     "end": float(np.mean(list(final_accuracy.values()))),
                     "end_by_family": final_accuracy,
                     "gain": held_out_gain(run.eval_set, records[0].get("eval/accuracy_by_family"), final_accuracy,
                                           level=run.curriculum.start_level, families=run.cfg.curriculum.families)},
        "eval_losses": {final_step: loss},
        "sampler": sampler_summary(trained, run.cfg),
        "tasks": run.judge.tasks.record(),
        "dtypes": engines.dtypes(run.engine),
    }  # fmt: skip


def nothing_solved(records: list[GrpoRecord]) -> str | None:
    """The warning for a run in which no completion reached its family's success_at: a bar
    above what the user's rewards give stalls the curriculum, and a verifier-only bar is
    refused earlier, with the config; None when something was solved."""
    logged = [r for r in records if "reward/solved" in r]
    if not logged or any(r["reward/solved"] for r in logged):
        return None
    return (f"grpo: no completion reached its family's success_at in {len(logged)} logged steps (the largest "
            f"reward was {max(r['reward/max'] for r in logged):g}), so no level could be passed; compare "
            "tasks.success_at with what the rewards give")  # fmt: skip


def sampler_summary(records: list[GrpoRecord], cfg: GrpoSettings) -> SamplerSummary:
    """What the sampler-trainer gap was over the run (the steps logged), whether the truncated
    importance correction was applied (`grpo.sampler_correction`), and how often an MoE
    policy's trainer routed a sampled token to other experts than its sampler did."""
    logged = [r for r in records if "train/sampler_logprob_gap_mean" in r]
    flips = [r["moe/routing_flip_share"] for r in records if "moe/routing_flip_share" in r]
    correction = cfg.sampler_correction
    return {
        "logprob_gap_mean": float(np.mean([r["train/sampler_logprob_gap_mean"] for r in logged])) if logged else None,
        "logprob_gap_max": max((r["train/sampler_logprob_gap_max"] for r in logged), default=None),
        "kl_mean": float(np.mean([r["train/sampler_kl"] for r in logged])) if logged else None,
        "correction": None if correction is None else {"cap": correction.cap},
        "routing_flip_share_mean": float(np.mean(flips)) if flips else None,
        "routing_flip_share_max": max(flips, default=None),
    }  # fmt: skip


def held_out_gain(
    eval_set: list[Problem],
    start: dict[str, float] | None,
    end: dict[str, float],
    *,
    level: int,
    families: Sequence[str] | None = None,
) -> GainReport | None:
    """The summary's gain report (stagetrain.evaluate.heldout.gains) from per-family accuracies on the
    fixed held-out set, whose problems give each family's level and count, its mean over
    `families` (the curriculum's); None without a start measurement (a metrics file that lost
    its step-0 record)."""
    if start is None:
        return None
    keys: dict[str, dict[int, list[str]]] = {}
    for p in eval_set:
        keys.setdefault(p.family, {}).setdefault(p.level, []).append(p.key)

    def measured(accuracy: dict[str, float]) -> dict[str, dict[int, tuple[float, int, int]]]:
        return {
            f: {lv: (accuracy[f], len(k), len(set(k))) for lv, k in by_level.items()}
            for f, by_level in keys.items()
        }

    return gains(measured(start), measured(end), level=level, families=families)


def rank(spec: GrpoJob) -> None:
    """One rank of the GRPO stage: train, evaluate, then (rank 0) write the outputs."""
    run = setup(spec)
    quiet_other_ranks()
    done = loop(run)
    final_accuracy, loss = done.final_accuracy or accuracy(run), val_loss(run)
    if dist.get_rank() == 0:
        warning = nothing_solved(run.loop.records())
        if warning:
            log.warning(warning)
        kept = (run.loop.checkpoints.folder / "completions.jsonl").read_text()
        atomic_write_text(spec["completions"], kept)
        write_table([json.loads(line) for line in kept.splitlines()], spec["completions_table"])
        run.loop.write_outputs(
            summarise(run, done, final_accuracy, loss), grpo_steps.reward_plot, spec["reward_plot"]
        )


if __name__ == "__main__":
    rank_main(rank)
