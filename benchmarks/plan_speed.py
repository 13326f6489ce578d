"""Benchmark: how long planning takes, for a grid of model sizes and GPU counts, and a full-DAG dry run.

    python benchmarks/plan_speed.py

Each planner time is the median of 5 warm runs, printed beside the time of
building the same model whole on the meta device (what the planner avoids by
counting one and two layers), so the ratio means the same on a busy machine.
The dry-run time of the whole DAG is printed beside `snakemake --version`,
Snakemake's own start-up cost: of a fresh run, of a planned one (the DAG reads the plan from
plan.json) and of a planned one after an edit the planner reads (the DAG plans in Snakemake's
process: planning.ahead), in a scratch copy planned first. Target: a 70B model over 64 GPUs
plans in under a second.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import ModelSettings
from stagetrain.hardware.detect import describe
from stagetrain.model.config import build_config
from stagetrain.planning.plan import PlanRecord
from stagetrain.planning.resolve import PlannerSettings, resolve

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # Llama shapes: hidden, intermediate, layers, heads, kv heads, vocab
    "1B": (2048, 8192, 16, 32, 8, 128256),
    "8B": (4096, 14336, 32, 32, 8, 128256),
    "70B": (8192, 28672, 80, 64, 8, 128256),
}
GPUS = (8, 64, 512)


def _config(model: str, gpus: int) -> dict:
    hidden, inter, layers, heads, kv, vocab = MODELS[model]
    return stconfig.validate(
        {
            "model": {
                "architecture": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_layers": layers,
                "num_heads": heads, "num_kv_heads": kv, "max_position_embeddings": 8192,
                "rope_theta": 500000.0, "tie_word_embeddings": False,
            },
            "tokenizer": {"vocab_size": vocab},
            "hardware": {"source": "describe", "gpu": "H100", "gpus_per_node": 8, "nodes": gpus // 8,
                         "host_memory_gib": 2048},
            "pretrain": {"seq_len": 4096, "global_batch_size": 4 * gpus},
            "grpo": {"prompts_per_step": gpus, "max_prompt_len": 512, "max_new_tokens": 1024},
        }
    )  # fmt: skip


def _median(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plan(cfg: dict) -> PlanRecord:
    settings = PlannerSettings.from_config(cfg)
    return resolve(describe(settings.hardware), settings)


def _meta_build(cfg: dict) -> None:
    config = build_config(
        ModelSettings.from_config(cfg["model"], "model"), cfg["tokenizer"]["vocab_size"]
    )
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def main() -> None:
    _plan(_config("1B", 8))  # warm imports and transformers' lazy modules
    print(
        f"{'model':>6} {'GPUs':>5} {'plan s':>8} {'meta build s':>13} {'ratio':>6}  candidates  chosen (pretrain)"
    )
    for model in MODELS:
        for gpus in GPUS:
            cfg = _config(model, gpus)
            plan_s = _median(lambda cfg=cfg: _plan(cfg))
            meta_s = _median(lambda cfg=cfg: _meta_build(cfg), repeat=1)
            stage = _plan(cfg)["stages"]["pretrain"]
            lay = stage["layout"]
            chosen = f"tp={lay['tp']} zero={lay['zero_stage']} mbs={lay['micro_batch_size']} ac={lay['activation_checkpointing']}"
            print(
                f"{model:>6} {gpus:>5} {plan_s:8.3f} {meta_s:13.3f} {plan_s / meta_s:6.2f}"
                f"  {stage['candidates']['considered']:>10}  {chosen}"
            )
    _dry_runs()


def _dry_runs() -> None:
    """`snakemake -n all` against `snakemake --version`, in a scratch copy of the workflow."""
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in ("Snakefile", "workflow", "config", "scripts", "profiles", "examples"):
            (shutil.copytree if (REPO / part).is_dir() else shutil.copy)(REPO / part, work / part)

        def timed(*args: str) -> float:
            command = [snakemake, "--cores", "2", *args]
            return _median(
                lambda: subprocess.run(command, cwd=work, check=True, capture_output=True), 3
            )

        base = timed("--version")
        rows = [("fresh", timed("-n", "all"))]
        subprocess.run(
            [snakemake, "--cores", "2", "plan"], cwd=work, check=True, capture_output=True
        )
        rows.append(("planned", timed("-n", "all")))
        config = work / "config/config.yaml"
        config.write_text(config.read_text().replace("group_size: 8 ", "group_size: 4 "))
        rows.append(("after a group_size edit", timed("-n", "all")))
    for name, dry in rows:
        print(
            f"dry run, {name}: {dry:.2f} s; snakemake --version: {base:.2f} s; ratio {dry / base:.2f}"
        )


if __name__ == "__main__":
    main()
