"""The GRPO loop, run on every rank by torchrun: `python -m stagetrain.grpo.train --spec job.json`.

Per step: each data-parallel rank draws its share of the prompts from the
curriculum (a family, then a level from that family's own curriculum), rolls
them out (flat or tree) with the policy's KV-cached `generate` (under ZeRO-3
with the parameters gathered for the whole phase and released after it, as
TRL's ds3 gather does), scores them with the verifiers, and trains through the
DeepSpeed engine: `engine.backward` and `engine.step` for exactly the
configured accumulation steps, `passes` times. Outcomes are gathered from all
ranks so every rank updates the same per-family curriculum states.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagetrain.errors import StageError
from stagetrain.grpo import steps as grpo_steps
from stagetrain.grpo.curriculum import Curriculum, CurriculumConfig, top_level
from stagetrain.grpo.metrics import METRICS
from stagetrain.grpo.tree import TreeConfig
from stagetrain.io import atomic_write_json, read_json
from stagetrain.tasks import Problem, problems
from stagetrain.training import engine as engines
from stagetrain.training.batches import window_count
from stagetrain.training.checkpoints import Checkpoints, tag_of
from stagetrain.training.engine import gathered
from stagetrain.training.evaluation import greedy_scores, validation_loss
from stagetrain.training.layout import StageLayout
from stagetrain.training.metrics import WINDOW_LOG, MetricsLog, check_finite, tensorboard_dir
from stagetrain.training.rank import rank_main

log = logging.getLogger("stagetrain")
PROMPT_RECORD = {
    "step": "GRPO steps completed",
    "prompts": "problem keys of the step, dp ranks in order",
}
NOT_MATHS = (
    "eval_problems",
    "eval_every",
    "eval_batches",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
)


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once by `setup`."""

    spec: dict[str, Any]
    cfg: dict[str, Any]
    engine: Any
    reference: Any
    tokenizer: Any
    device: torch.device
    layout: StageLayout
    dp_rank: int
    curriculum: CurriculumConfig
    tree: TreeConfig | None
    eval_set: list[Problem]
    checkpoints: Checkpoints
    val: np.ndarray
    eval_windows: np.ndarray
    generation_batch: int
    """Most sequences one `generate` call makes: the plan counted their KV cache."""


def _reference(
    model_dir: str, ds_config: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> Any:
    """The frozen reference policy: partitioned like the policy under ZeRO-3, a plain copy otherwise."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine.eval()
    return model.to(device=device, dtype=dtype).eval()


def setup(spec: dict[str, Any]) -> Run:
    """Process group, world check, policy engine (from the consolidated pretrain model), reference, data."""
    plan, meta, ds_config, device = engines.join_world(spec)
    cfg, layout = spec["grpo"], StageLayout.from_plan(plan, "grpo")
    manifest = read_json(Path(spec["model"]) / "MANIFEST.json")
    components = {  # the start model by content: a resharded folder of the same weights resumes
        "model": {"weights": manifest["weights_sha256"], "config": manifest["files"]["config.json"]["sha256"]},
        "tokenizer": meta["tokenizer_sha256"],
        "training": {k: v for k, v in cfg.items() if k not in NOT_MATHS},
        "precision": layout.precision, "seed": spec["seed"],
    }  # fmt: skip
    checkpoints = Checkpoints(Path(spec["checkpoints"]), components,
                              layout.checkpoint_layout, cfg["keep_checkpoints"])  # fmt: skip
    checkpoints.hold()  # before anything is built or written: a second run of the stage stops here
    config = engines.load_model_config(spec["model_config"])
    engine, _, spec["_hook"] = engines.build(
        config=config, ds_config=ds_config, init_from=spec["model"],
        activation_checkpointing=layout.activation_checkpointing, seed=spec["seed"],
    )  # fmt: skip
    dtype = next(engine.module.parameters()).dtype
    reference = _reference(spec["model"], ds_config, device, dtype) if cfg["kl_coef"] > 0 else None
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    curriculum = CurriculumConfig(**{k: v for k, v in cfg["curriculum"].items() if k != "families"})
    tree = None
    if cfg["rollout"] == "tree":
        tree = TreeConfig(**cfg["tree"], max_leaves=cfg["group_size"], max_tokens=cfg["group_size"] * cfg["max_new_tokens"],
                          max_new_tokens=cfg["max_new_tokens"], eos_id=tokenizer.eos_token_id)  # fmt: skip
    seq = layout.seq_len  # the plan's: max_prompt_len + max_new_tokens
    val = np.memmap(spec["val"], dtype=meta["dtype"], mode="r")
    eval_set = [p for family in cfg["curriculum"]["families"]
                for p in problems([family], [min(curriculum.start_level, top_level(curriculum, family))], "test",
                                  cfg["eval_problems"], seed=spec["seed"])]  # fmt: skip
    return Run(
        spec=spec, cfg=cfg, engine=engine, reference=reference, tokenizer=tokenizer, device=device, layout=layout,
        dp_rank=dist.get_rank(group=engine.data_parallel_group), curriculum=curriculum, tree=tree, eval_set=eval_set,
        checkpoints=checkpoints,
        val=val, eval_windows=np.arange(min(window_count(len(val), seq), cfg["eval_batches"] * layout.micro_batch_size)),
        generation_batch=_generation_batch(plan),
    )  # fmt: skip


def _generation_batch(plan: dict[str, Any]) -> int:
    if "generation" not in plan["stages"]["grpo"]:
        raise StageError(
            "plan.json: no grpo.generation batch (planned by an older stagetrain): "
            "replan with `snakemake --cores all --forcerun plan_parallelism`"
        )
    return plan["stages"]["grpo"]["generation"]["batch"]


def accuracy(run: Run) -> dict[str, float]:
    """Greedy accuracy per family on the fixed held-out problems (every rank evaluates all of them)."""
    run.engine.eval()
    with gathered(run.engine), torch.no_grad():
        correct = greedy_scores(
            run.engine.module, run.tokenizer, run.eval_set, run.cfg, run.generation_batch
        )
    run.engine.train()
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


def loop(run: Run) -> dict[str, Any]:
    """Train from the latest checkpoint (or the pretrained model) to grpo.steps; return the summary's core."""
    cfg, rank0 = run.cfg, dist.get_rank() == 0
    curriculum, start = Curriculum.start(run.curriculum, cfg["curriculum"]["families"]), 0
    pointer = run.checkpoints.latest()
    if pointer:
        client = run.checkpoints.load(run.engine, pointer)
        try:
            start, curriculum = client["step"], Curriculum.from_json(client["curriculum"])
        except StageError as err:
            raise StageError(f"{run.checkpoints.folder / pointer['tag']}: {err}") from None
        log.info(
            "resuming from %s at step %d (levels %s)",
            pointer["tag"],
            start,
            _levels(curriculum.levels()),
        )
    elif rank0 and (why := run.checkpoints.why_fresh()):
        log.info(why)
    metrics = (
        MetricsLog(
            run.checkpoints.folder / "metrics.jsonl", start, METRICS, tensorboard_dir(run.spec)
        )
        if rank0
        else None
    )
    prompts_log = (  # the debug option of pretrain's window log: the problems each step drew
        MetricsLog(run.checkpoints.folder / "prompts.jsonl", start, PROMPT_RECORD)
        if rank0 and os.environ.get(WINDOW_LOG) == "1"
        else None
    )
    began = time.monotonic()
    if start == 0 and metrics:
        metrics.write({"step": 0, **_accuracy_record(accuracy(run))})
    elif start == 0:
        accuracy(run)
    for step in range(start + 1, cfg["steps"] + 1):
        # Sampling the completions: per rank (the prompts are global, steps.step_prompts).
        torch.manual_seed(random.Random(f"{run.spec['seed']}:{step}:{run.dp_rank}").getrandbits(63))
        t0 = time.monotonic()
        record = grpo_steps.step(run, curriculum, step)
        check_finite(record["train/loss"], what="training loss", stage="grpo", step=step,
                     precision=run.layout.precision)  # fmt: skip
        record.update({"step": step, "time/elapsed_s": time.monotonic() - began})
        record["throughput/tokens_per_s"] = record.pop("_tokens") / (time.monotonic() - t0)
        if prompts_log:
            prompts_log.write({"step": step, "prompts": record.pop("_prompts")})
        record.pop("_prompts", None)
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            record.update(_accuracy_record(accuracy(run)))
        if metrics and (
            step % cfg["log_every"] == 0
            or "eval/accuracy" in record
            or "curriculum/events" in record
        ):
            metrics.write(record)
            log.info("step %d/%d reward %.3f levels %s loss %.4f tokens/s %.0f", step, cfg["steps"],
                     record["reward/mean"], _levels(record["curriculum/level"]), record["train/loss"],
                     record["throughput/tokens_per_s"])  # fmt: skip
        if step % cfg["checkpoint_every"] == 0 or step == cfg["steps"]:
            run.checkpoints.save(
                run.engine, step, {"step": step, "curriculum": curriculum.to_json()}
            )
    return {"final_step": cfg["steps"], "resumed_from_step": start, "curriculum": curriculum.to_json(),
            "optimizer_steps": run.engine.global_steps}  # fmt: skip


def _accuracy_record(by_family: dict[str, float]) -> dict[str, Any]:
    """The metrics of one held-out evaluation: the mean over families and each family's."""
    return {
        "eval/accuracy": float(np.mean(list(by_family.values()))),
        "eval/accuracy_by_family": by_family,
    }


def _levels(levels: dict[str, int]) -> str:
    """{family: level} for a log line: "arithmetic=1 comparison=2"."""
    return " ".join(f"{family}={level}" for family, level in levels.items())


def summarise(
    run: Run, core: dict[str, Any], final_accuracy: dict[str, float], loss: float
) -> dict[str, Any]:
    """summary.json of the GRPO stage (the same checkpoint and evaluation keys as pretrain's)."""
    records = [
        json.loads(line)
        for line in (run.checkpoints.folder / "metrics.jsonl").read_text().splitlines()
    ]
    trained = [r for r in records if "train/loss" in r]
    return {
        "stage": "grpo", **core, "layout": run.layout.to_json(), "fingerprint": run.checkpoints.folder.name,
        "checkpoint": {"folder": str(run.checkpoints.folder), "tag": tag_of(core["final_step"])},
        "losses": {r["step"]: r["train/loss"] for r in trained}, "final_loss": trained[-1]["train/loss"] if trained else None,
        "rewards": {r["step"]: r["reward/mean"] for r in trained},
        "levels": {r["step"]: r["curriculum/level"] for r in trained},
        "accuracy": {"start": records[0].get("eval/accuracy"), "start_by_family": records[0].get("eval/accuracy_by_family"),
                     "end": float(np.mean(list(final_accuracy.values()))),
                     "end_by_family": final_accuracy},
        "eval_losses": {core["final_step"]: loss}, "final_eval_loss": loss,
        "eval_batch": {"shard": run.spec["val"], "windows": run.eval_windows.tolist(), "seq_len": run.layout.seq_len,
                       "micro_batch_size": run.layout.micro_batch_size},
    }  # fmt: skip


def rank(spec: dict[str, Any]) -> None:
    """One rank of the GRPO stage: train, evaluate, then (rank 0) write the outputs."""
    run = setup(spec)
    if dist.get_rank() != 0:
        logging.getLogger("stagetrain").setLevel(logging.WARNING)
    core = loop(run)
    final_accuracy, loss = accuracy(run), val_loss(run)
    if dist.get_rank() == 0:
        summary = {
            **summarise(run, core, final_accuracy, loss),
            "dtypes": engines.dtypes(run.engine),
        }
        Path(spec["metrics"]).write_bytes((run.checkpoints.folder / "metrics.jsonl").read_bytes())
        grpo_steps.reward_plot(summary, spec["reward_plot"])
        atomic_write_json(spec["summary"], summary)


if __name__ == "__main__":
    rank_main(rank)
