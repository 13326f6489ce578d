"""grpo: improve the consolidated pretrain model with curriculum GRPO on verifiable tasks.

Snakemake runs it through the `grpo` rule; the ranks run `python -m stagetrain.grpo.train`
with checkpoints in results/<run>/checkpoints/grpo/<fingerprint>/. On its own:
    python scripts/grpo.py --config config/config.yaml --model results/tiny/model/pretrain \
        --plan results/tiny/plan/grpo.json --deepspeed-config results/tiny/deepspeed/grpo.json \
        --tokenizer results/tiny/tokenizer --model-config results/tiny/model_config.json \
        --meta results/tiny/data/meta.json --val results/tiny/data/val.bin \
        --summary results/tiny/grpo/summary.json --metrics results/tiny/grpo/metrics.jsonl \
        --reward-plot results/tiny/grpo/reward.png --completions results/tiny/grpo/completions.jsonl \
        --completions-table results/tiny/grpo/completions.html
"""

from stagetrain.config.settings import TrackingSettings
from stagetrain.training.launch import grpo_part, launch_stage
from stagetrain.workflow.stage import StageIO, run_stage


def main(io: StageIO) -> None:
    launch_stage(
        stage="grpo",
        module="stagetrain.grpo.train",
        # task and reward files are read through the tasks section
        inputs={k: v for k, v in io.inputs.items() if k not in ("task_files", "reward_files")},
        outputs=io.outputs,
        part=grpo_part(io.sections),
        tracking=TrackingSettings.from_config(io.sections["tracking"], "tracking"),
    )


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=["model", "plan", "deepspeed_config", "tokenizer", "model_config", "meta", "val"],
    outputs=["summary", "metrics", "reward_plot", "completions", "completions_table"],
    sections=["run", "grpo", "tasks", "tracking"],
)
