"""Running the real pretrain entry point under torchrun with a chosen layout, for the distributed tests.

One small corpus and tokenizer are prepared per test session; each run gets
its own plan (layout fixed through the config's parallelism section, so the
planner's own validation applies), its DeepSpeed config from the renderer, and
its own checkpoint folder.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from conftest import default_config
from harness.planning import cpu_hardware, plan_for

from stagetrain.deepspeed_config import render
from stagetrain.io import atomic_write_json
from stagetrain.model_config import training_config
from stagetrain.planning.derived import vocab_padding
from stagetrain.prepare_tokenizer import prepare
from stagetrain.settings import training_settings
from stagetrain.training.integrity import load_file, weights_only_loads
from stagetrain.training.launch import job_spec

SEQ_LEN = 32
GLOBAL_BATCH = 8


def small_config() -> dict[str, Any]:
    """The default config shrunk for multi-rank tests: fp32 (exact comparisons), short sequences."""
    cfg = default_config()
    cfg["data"].update(train_tokens=30_000, val_tokens=3_000)
    cfg["tokenizer"]["training_sample_mb"] = 0.2
    cfg["deepspeed"]["precision"] = "fp32"
    cfg["pretrain"].update(
        seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, steps=4, log_every=1, eval_every=4,
        checkpoint_every=4, eval_batches=2,
        optimizer={**cfg["pretrain"]["optimizer"], "lr": 3e-3, "warmup_steps": 1},
    )  # fmt: skip
    return cfg


def prepare_data(out: Path) -> dict[str, str]:
    """Tokenizer, shards and model config for the small config; their paths."""
    cfg = small_config()
    paths = {
        "tokenizer": out / "tokenizer", "train": out / "data/train.bin", "val": out / "data/val.bin",
        "meta": out / "data/meta.json", "model_config": out / "model_config.json",
    }  # fmt: skip
    prepare(run=cfg["run"], model=cfg["model"], tokenizer_cfg=cfg["tokenizer"], data=cfg["data"],
            tp=vocab_padding(plan_for(cfg, cpu_hardware()))["tp"],
            outputs={k: str(v) for k, v in paths.items()})  # fmt: skip
    return {k: str(v) for k, v in paths.items()}


@functools.cache
def build_comm_op() -> None:
    """Compile DeepSpeed's shared-memory comm op once, before any ranks start, as the
    stage's launcher does: ranks compiling it at once have crashed at teardown."""
    code = "from stagetrain.training.launch import prebuild_cpu_ops; prebuild_cpu_ops()"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=900)


def _torchrun(module: str, spec: Path, world: int, *, popen: bool = False) -> Any:
    """`module --spec spec` on `world` CPU ranks: a CompletedProcess, or a Popen if `popen`."""
    build_comm_op()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", module, "--spec", str(spec)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def launch(
    data: dict[str, str], out: Path, *, world: int, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run the pretrain entry point on `world` CPU ranks (`write_job`'s arguments); don't check the exit."""
    return _torchrun(
        "stagetrain.pretrain.train", write_job(data, out, world=world, **kwargs), world
    )


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
    """Plan, DeepSpeed config and job.json of a pretrain run of `world` CPU ranks on `nodes`
    nodes with `layout` fixed; the job.json's path."""
    cfg = small_config()
    for section, changes in (config_changes or {}).items():
        cfg[section] = {**cfg[section], **changes}
    cfg["parallelism"].update({"activation_checkpointing": False, "offload": "none", **layout})
    plan = plan_for(cfg, cpu_hardware(ranks=world // nodes, nodes=nodes))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan)
    atomic_write_json(
        out / "ds.json",
        render(stage="pretrain", plan=plan, deepspeed=cfg["deepspeed"], training=cfg["pretrain"]),
    )
    spec = job_spec(
        inputs={**data, "plan": out / "plan.json", "deepspeed_config": out / "ds.json",
                "model_config": model_config or data["model_config"]},
        outputs={"summary": out / "summary.json", "metrics": out / "metrics.jsonl", "loss_plot": out / "loss.png"},
        checkpoints=checkpoints or out / "checkpoints",
        extra={"pretrain": cfg["pretrain"], "model": cfg["model"], "seed": cfg["run"]["seed"]},
    )  # fmt: skip
    atomic_write_json(out / "job.json", spec)
    return out / "job.json"


def run(data: dict[str, str], out: Path, **kwargs: Any) -> dict[str, Any]:
    """`launch`, requiring success; the run's summary.json."""
    proc = launch(data, out, **kwargs)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads((out / "summary.json").read_text())


def final_params(summary: dict[str, Any]) -> dict[str, torch.Tensor]:
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
    config = training_config(model, tokenizer_size=512, special_ids=ids, tp=1)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model_config.json"
    path.write_text(config.to_json_string(use_diff=False))
    return str(path)


def grpo_config(**changes: Any) -> dict[str, Any]:
    """The small config with a short GRPO stage; `changes` override grpo keys."""
    cfg = small_config()
    cfg["grpo"].update(
        {
            "prompts_per_step": 4, "group_size": 4, "max_prompt_len": 32, "max_new_tokens": 8, "steps": 3,
            "eval_problems": 8, "eval_every": 3, "checkpoint_every": 3, "eval_batches": 1, "log_every": 1,
            "optimizer": {**cfg["grpo"]["optimizer"], "lr": 1e-4, "warmup_steps": 1},
            **changes,
        }
    )  # fmt: skip
    return cfg


def launch_grpo(
    data: dict[str, str], model_dir: str, out: Path, *, world: int, layout: dict[str, Any], cfg: dict[str, Any],
    checkpoints: Path | None = None, popen: bool = False,
) -> Any:  # fmt: skip
    """Run the GRPO entry point on `world` CPU ranks; a CompletedProcess, or a Popen if `popen`."""
    cfg["parallelism"].update({"activation_checkpointing": False, "offload": "none", **layout})
    plan = plan_for(cfg, cpu_hardware(ranks=world))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan)
    training = {
        "steps": training_settings("grpo", cfg["grpo"]).optimizer_steps,
        "optimizer": cfg["grpo"]["optimizer"],
    }
    atomic_write_json(
        out / "ds.json",
        render(stage="grpo", plan=plan, deepspeed=cfg["deepspeed"], training=training),
    )
    spec = job_spec(
        inputs={**data, "model": model_dir, "plan": out / "plan.json", "deepspeed_config": out / "ds.json"},
        outputs={"summary": out / "summary.json", "metrics": out / "metrics.jsonl", "reward_plot": out / "reward.png"},
        checkpoints=checkpoints or out / "checkpoints",
        extra={"grpo": cfg["grpo"], "seed": cfg["run"]["seed"]},
    )  # fmt: skip
    atomic_write_json(out / "job.json", spec)
    return _torchrun("stagetrain.grpo.train", out / "job.json", world, popen=popen)


def run_grpo(data: dict[str, str], model_dir: str, out: Path, **kwargs: Any) -> dict[str, Any]:
    """`launch_grpo`, requiring success; the run's summary.json."""
    proc = launch_grpo(data, model_dir, out, **kwargs)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads((out / "summary.json").read_text())
