"""pretrain: train the model on every rank the plan asks for; write summary, metrics and the loss curve.

Snakemake runs it through the `pretrain` rule. It writes the job spec, then
starts the ranks with torchrun (srun + torchrun on several nodes) running
`python -m stagetrain.pretrain.train`. Checkpoints go to
results/<run>/checkpoints/pretrain/<fingerprint>/, outside the declared outputs,
so a rerun after a crash resumes from the newest complete one. On its own:
    python scripts/pretrain.py --config config/config.yaml --plan results/tiny/plan.json \
        --deepspeed-config results/tiny/deepspeed/pretrain.json --tokenizer results/tiny/tokenizer \
        --train results/tiny/data/train.bin --val results/tiny/data/val.bin --meta results/tiny/data/meta.json \
        --model-config results/tiny/model_config.json --summary results/tiny/pretrain/summary.json \
        --metrics results/tiny/pretrain/metrics.jsonl --loss-plot results/tiny/pretrain/loss.png
"""

import os
from pathlib import Path

from stagetrain.io import atomic_write_json, read_json
from stagetrain.pretrain.launch import (
    prebuild_cpu_ops,
    rank_environment,
    run_ranks,
    torchrun_command,
)
from stagetrain.stage import StageIO, run_stage

INPUTS = ["plan", "deepspeed_config", "tokenizer", "train", "val", "meta", "model_config"]
OUTPUTS = ["summary", "metrics", "loss_plot"]


def main(io: StageIO) -> None:
    plan = read_json(io.inputs["plan"])
    root = Path(io.outputs["summary"]).resolve().parents[1] / "checkpoints" / "pretrain"
    spec = {
        **{k: str(Path(v).resolve()) for k, v in {**io.inputs, **io.outputs}.items()},
        "checkpoints": str(root),
        "pretrain": io.sections["pretrain"],
        "model": io.sections["model"],
        "seed": io.sections["run"]["seed"],
    }
    atomic_write_json(root / "job.json", spec)
    env = rank_environment(
        os.environ, cores=len(os.sched_getaffinity(0)), ranks_per_node=plan["ranks_per_node"]
    )
    if plan["backend"] == "gloo":
        prebuild_cpu_ops()
    cmd = torchrun_command(
        nodes=plan["nodes"], procs_per_node=plan["ranks_per_node"], module="stagetrain.pretrain.train",
        args=["--spec", str(root / "job.json")], env=env,
    )  # fmt: skip
    run_ranks(cmd, env, "pretrain")


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=INPUTS,
    outputs=OUTPUTS,
    sections=["run", "model", "pretrain"],
)
