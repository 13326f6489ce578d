"""pretrain: train the model on every rank the plan asks for; write summary, metrics and the loss curve.

Snakemake runs it through the `pretrain` rule. It writes the job spec, then
starts the ranks with torchrun (srun + torchrun on several nodes) running
`python -m stagetrain.pretrain.train`. Checkpoints go to
results/<run>/checkpoints/pretrain/<fingerprint>/, outside the declared outputs,
so a rerun after a crash resumes from the newest complete one. On its own:
    python scripts/pretrain.py --config config/config.yaml --plan results/tiny/plan/pretrain.json \
        --deepspeed-config results/tiny/deepspeed/pretrain.json --tokenizer results/tiny/tokenizer \
        --train results/tiny/data/train.bin --val results/tiny/data/val.bin --meta results/tiny/data/meta.json \
        --model-config results/tiny/model_config.json --summary results/tiny/pretrain/summary.json \
        --metrics results/tiny/pretrain/metrics.jsonl --loss-plot results/tiny/pretrain/loss.png
"""

from stagetrain.config.settings import TrackingSettings
from stagetrain.io import read_json
from stagetrain.planning.derived import whole_plan
from stagetrain.training.launch import launch_stage, pretrain_part
from stagetrain.workflow.stage import StageIO, run_stage

INPUTS = ["plan", "deepspeed_config", "tokenizer", "train", "val", "meta", "model_config"]
"""What the ranks read. The rule's `init_from` input (a local model's files) is there for
Snakemake to rerun on an edit; the ranks read model.init_from from the model section."""


def main(io: StageIO) -> None:
    smk = globals().get("snakemake")
    # The prediction the summary reports against: the rule's from the plan worked out with the
    # DAG (never a rerun trigger: it moves with every measurement), else plan.json's.
    throughput = (
        smk.params.predicted
        if smk is not None
        else read_json(whole_plan(io.inputs["plan"]))["stages"]["pretrain"]["throughput"]
    )
    launch_stage(
        stage="pretrain",
        module="stagetrain.pretrain.train",
        inputs={name: io.inputs[name] for name in INPUTS},
        outputs=io.outputs,
        part=pretrain_part(io.sections, throughput),
        tracking=TrackingSettings.from_config(io.sections["tracking"], "tracking"),
    )


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=INPUTS,
    outputs=["summary", "metrics", "loss_plot"],
    sections=["run", "model", "pretrain", "tracking"],
)
