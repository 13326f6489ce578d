"""Running the real training entry points under torchrun with a chosen layout, for the multi-rank tests.

One small corpus and tokenizer are prepared per test session (`prepare_data`);
each run gets its own plan (layout fixed through the config's parallelism
section, so the planner's own validation applies), its DeepSpeed config from
the renderer, and its own checkpoint folder. The config is the default one
with the named tiny configs tiny.yaml and tiny-ranks.yaml on top (fp32, so
that runs can be compared exactly). `SharedRuns` keeps the two-rank runs that
several test modules read, so that each is made once per test run (`sessions.made_once`).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stagetrain.config.settings import ConsolidateSettings, DeepSpeedSettings, training_settings
from stagetrain.io import atomic_write_json
from stagetrain.model.config import training_config
from stagetrain.planning.derived import vocab_padding
from stagetrain.pretrain.summary import PretrainSummary
from stagetrain.tokenizer.prepare import prepare
from stagetrain.training.deepspeed_config import render
from stagetrain.training.integrity import load_file, weights_only_loads
from stagetrain.training.launch import grpo_part, job_spec, pretrain_part, torchrun_command
from stagetrain.training.summary import StageSummary

from .configs import merge, model_settings, named_config
from .planning import cpu_hardware, plan_for
from .sessions import made_once

if TYPE_CHECKING:
    from stagetrain.grpo.summary import GrpoSummary

FIXED = {"activation_checkpointing": False, "offload": "none"}
"""What every harness run fixes beside the layout a test asks for."""


def small_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """The config of the multi-rank runs: tests/configs/tiny.yaml and tiny-ranks.yaml on the
    default config (fp32, short sequences), with `sections` (section -> keys) changed on top."""
    return named_config("tiny", "tiny-ranks", **sections)


def prepare_data(out: Path) -> dict[str, str]:
    """Tokenizer, shards and model config for the small config; their paths."""
    cfg = small_config()
    paths = {
        "tokenizer": out / "tokenizer", "train": out / "data/train.bin", "val": out / "data/val.bin",
        "meta": out / "data/meta.json", "model_config": out / "model_config.json",
    }  # fmt: skip
    prepare(cfg, tp=vocab_padding(plan_for(cfg, cpu_hardware()))["tp"],
            outputs={k: str(v) for k, v in paths.items()})  # fmt: skip
    return {k: str(v) for k, v in paths.items()}


def torchrun(module: str, spec: Path, world: int, *, popen: bool = False) -> Any:
    """`module --spec spec` on `world` CPU ranks of one thread each: a CompletedProcess (not
    checked), or a Popen if `popen`."""
    cmd = torchrun_command(nodes=1, procs_per_node=world, module=module, args=["--spec", str(spec)],
                           allocation=None)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def write_job(
    data: dict[str, str],
    out: Path,
    *,
    world: int,
    layout: dict[str, Any],
    nodes: int = 1,
    config_changes: dict[str, dict[str, Any]] | None = None,
    model_config: str | None = None,
    checkpoints: Path | None = None,
) -> Path:
    """Write a pretrain run's plan (`world` CPU ranks on `nodes` nodes, `layout` fixed), DeepSpeed
    config and job spec into `out`, as the stage's rule would; the spec's path."""
    cfg = small_config(**(config_changes or {}), parallelism={**FIXED, **layout})
    plan = plan_for(cfg, cpu_hardware(ranks=world // nodes, nodes=nodes))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan)
    atomic_write_json(
        out / "ds.json",
        render(
            stage="pretrain",
            plan=plan,
            deepspeed=DeepSpeedSettings.from_config(cfg["deepspeed"]),
            training=training_settings("pretrain", cfg["pretrain"]),
        ),
    )
    spec = job_spec(
        inputs={**data, "plan": out / "plan.json", "deepspeed_config": out / "ds.json",
                "model_config": model_config or data["model_config"]},
        outputs={"summary": out / "summary.json", "metrics": out / "metrics.jsonl", "loss_plot": out / "loss.png"},
        checkpoints=checkpoints or out / "checkpoints",
        part=pretrain_part(cfg, plan["stages"]["pretrain"]["throughput"]),
    )  # fmt: skip
    atomic_write_json(out / "job.json", spec)
    return out / "job.json"


def launch(
    data: dict[str, str], out: Path, *, world: int, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run the pretrain entry point on `world` CPU ranks (`write_job`'s arguments); don't check the exit."""
    return torchrun("stagetrain.pretrain.train", write_job(data, out, world=world, **kwargs), world)


def run(data: dict[str, str], out: Path, **kwargs: Any) -> PretrainSummary:
    """`launch`, requiring success; the run's summary.json."""
    proc = launch(data, out, **kwargs)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads((out / "summary.json").read_text())


def final_params(summary: StageSummary) -> dict[str, torch.Tensor]:
    """The fp32 weights of the run's final checkpoint, by parameter name."""
    folder, tag = summary["checkpoint"]["folder"], summary["checkpoint"]["tag"]
    if summary["layout"]["zero_stage"] == 0:
        states = load_file(Path(folder) / tag / "mp_rank_00_model_states.pt")
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with weights_only_loads():
        weights = get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag)
    return {k: v.float() for k, v in weights.items()}


def model_config(out: Path, **changes: Any) -> str:
    """A model_config.json with the shared tokenizer's vocabulary and `changes` to the model section."""
    model = {**copy.deepcopy(small_config()["model"]), **changes}
    ids = {"eos_token_id": 1, "pad_token_id": 2}
    config = training_config(model_settings(model), tokenizer_size=512, special_ids=ids, tp=1)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model_config.json"
    path.write_text(config.to_json_string(use_diff=False))
    return str(path)


def grpo_config(**changes: Any) -> dict[str, Any]:
    """The multi-rank config with tests/configs/tiny-grpo.yaml, three steps of prompts at most 64
    tokens long; `changes` override grpo keys (nested mappings merged)."""
    grpo = {"max_prompt_len": 64, "steps": 3, "eval_every": 3, "checkpoint_every": 3, "log_every": 1,
            "optimizer": {"lr": 1e-4}}  # fmt: skip
    cfg = named_config("tiny", "tiny-ranks", "tiny-grpo", grpo=grpo)
    return merge(cfg, {"grpo": changes})


def launch_grpo(
    data: dict[str, str], model_dir: str, out: Path, *, world: int, layout: dict[str, Any], cfg: dict[str, Any],
    checkpoints: Path | None = None, popen: bool = False, generation_batch: int | None = None,
    gather: str | None = None, partition_all: bool = False,
) -> Any:  # fmt: skip
    """Run the GRPO entry point on `world` CPU ranks; a CompletedProcess, or a Popen if `popen`.
    `generation_batch` and `gather` replace the plan's (the most sequences one generate call may
    make; how ZeRO-3 gathers for it). `partition_all`: ZeRO-3 partitions every parameter, where
    DeepSpeed would keep a tiny model's (each under 1e5 elements) whole on every rank."""
    cfg = merge(copy.deepcopy(cfg), {"parallelism": {**FIXED, **layout}})
    plan = plan_for(cfg, cpu_hardware(ranks=world))
    if generation_batch is not None:
        plan["stages"]["grpo"]["generation"]["batch"] = generation_batch
    if gather is not None:
        plan["stages"]["grpo"]["generation"]["gather"] = gather
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan)
    training = training_settings("grpo", cfg["grpo"])
    ds = render(stage="grpo", plan=plan, deepspeed=DeepSpeedSettings.from_config(cfg["deepspeed"]),
                training=training)  # fmt: skip
    if partition_all:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # type: ignore[typeddict-unknown-key]
    atomic_write_json(out / "ds.json", ds)
    spec = job_spec(
        inputs={**data, "model": model_dir, "plan": out / "plan.json", "deepspeed_config": out / "ds.json"},
        outputs={"summary": out / "summary.json", "metrics": out / "metrics.jsonl", "reward_plot": out / "reward.png",
                 "completions": out / "completions.jsonl", "completions_table": out / "completions.html"},
        checkpoints=checkpoints or out / "checkpoints",
        part=grpo_part(cfg),
    )  # fmt: skip
    atomic_write_json(out / "job.json", spec)
    return torchrun("stagetrain.grpo.train", out / "job.json", world, popen=popen)


def run_grpo(data: dict[str, str], model_dir: str, out: Path, **kwargs: Any) -> GrpoSummary:
    """`launch_grpo`, requiring success; the run's summary.json."""
    proc = launch_grpo(data, model_dir, out, **kwargs)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads((out / "summary.json").read_text())


def dp2(zero_stage: int) -> dict[str, Any]:
    """Two data-parallel ranks, micro batch 2 (accumulation 2 at the tiny global batch)."""
    return {"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": zero_stage}


MOE = {
    "architecture": "mixtral",
    "num_experts": 4,
    "experts_per_token": 2,
    "intermediate_size": 128,
}
"""The tiny model as a Mixtral: its sparse blocks are ZeRO-3 leaf modules."""

DEEPSEEK = {
    "architecture": "deepseek_v3",
    "num_experts": 4,
    "experts_per_token": 2,
    "moe_intermediate_size": 64,
    "num_shared_experts": 1,
    "first_dense_layers": 1,
    "num_kv_heads": 4,
    "intermediate_size": 128,
}
"""The tiny model as a DeepSeek-V3 (latent attention, one dense layer, then three MoE layers of
four routed experts and one shared): its router is balanced by a bias, not an aux loss."""

SHARED = {
    "zero0": (dp2(0), None), "zero1": (dp2(1), None), "zero2": (dp2(2), None), "zero3": (dp2(3), None),
    "tp2": ({"dp": 1, "tp": 2, "micro_batch_size": 4, "zero_stage": 1}, None), "moe": (dp2(3), MOE),
}  # fmt: skip
"""The two-rank runs (4 steps of the tiny config) that several test modules read: layout and the
model's changes (None: the shared data's model config)."""


class SharedRun(PretrainSummary):
    """A shared run's summary.json, with `model_config`: the file it trained."""

    model_config: str


class SharedRuns:
    """The runs of SHARED, each made on first use and kept: tests read them and copy before they
    damage anything. A run's summary gains `model_config`, the file it trained."""

    def __init__(self, data: dict[str, str], root: Path) -> None:
        self.data, self.root = data, root
        self._made: dict[str, SharedRun] = {}

    def __getitem__(self, name: str) -> SharedRun:
        if name not in self._made:
            self._made[name] = made_once(self.root / name, functools.partial(self._make, name))
        return self._made[name]

    def _make(self, name: str, out: Path) -> SharedRun:
        layout, model = SHARED[name]
        config = model_config(out / "model", **model) if model else self.data["model_config"]
        summary = run(self.data, out, world=2, layout=layout, model_config=config)
        return {**summary, "model_config": config}


SCORING_FAMILIES = ["counting", "comparison"]
"""The curriculum of GRPO tests that start from `scoring_model`: it answers counting level 1
often enough (greedy about 0.6) that a step's groups have rewards that vary."""


def scoring_model(data: dict[str, str], root: Path) -> str:
    """A consolidated fp32 model that scores: 150 steps of the tiny model on one rank (about
    20 s), after which a GRPO step on SCORING_FAMILIES has non-zero rewards and advantages.
    GRPO tests from a model that never scores compare zeros with zeros."""
    from stagetrain.consolidate.folder import consolidate

    steps = 150
    changes = {"pretrain": {"steps": steps, "eval_every": steps, "checkpoint_every": steps,
                            "optimizer": {"lr": 3e-3, "warmup_steps": 10}}}  # fmt: skip
    layout = {"dp": 1, "tp": 1, "micro_batch_size": 8, "zero_stage": 0}
    run(data, root / "pretrain", world=1, layout=layout, config_changes=changes)
    consolidate(stage="pretrain", summary_path=str(root / "pretrain/summary.json"), tokenizer_dir=data["tokenizer"],
                model_config_path=data["model_config"], meta_path=data["meta"], out=str(root / "model"),
                cfg=ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss"))  # fmt: skip
    return str(root / "model")


def metric_records(out: Path) -> list[dict[str, Any]]:
    """A training run's metrics.jsonl in `out`, one record per line."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_learning_signal(metrics: Path) -> None:
    """A GRPO run's records show what its comparisons rest on: some reward, and some group whose
    rewards vary (so advantages, and the gradient, are not all zero)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert steps and any(r["reward/mean"] > 0 for r in steps), steps
    assert any(r["frac_reward_zero_std"] < 1 for r in steps), steps
