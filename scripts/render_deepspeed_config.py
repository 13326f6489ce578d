"""render_deepspeed_config: write deepspeed/<stage>.json, checked by DeepSpeed's own parser.

Snakemake runs it through the `render_deepspeed_config` rule (wildcard: stage); on its own:
    python scripts/render_deepspeed_config.py --config config/config.yaml --stage pretrain \
        --plan results/tiny/plan/pretrain.json --deepspeed-config results/tiny/deepspeed/pretrain.json
"""

import logging

from stagetrain.config.settings import DeepSpeedSettings, training_settings
from stagetrain.training.deepspeed_config import render
from stagetrain.workflow.stage import StageIO, run_stage, training_stage

log = logging.getLogger("stagetrain")
smk = globals().get("snakemake")
STAGE = training_stage(smk)


def main(io: StageIO) -> None:
    # The rule passes the stage's optimizer steps as `steps` (passes already counted, so
    # the section's `passes` is its default, 1); run on its own, the whole stage section.
    config = render(
        stage=STAGE,
        plan=io.read_input("plan"),
        deepspeed=DeepSpeedSettings.from_config(io.sections["deepspeed"], "deepspeed"),
        training=training_settings(STAGE, io.sections["training"]),
    )
    zero = config["zero_optimization"]["stage"]
    log.info(
        "%s: train_batch_size=%d micro=%d accumulation=%d zero=%d; accepted by DeepSpeed",
        STAGE, config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"], zero,
    )  # fmt: skip
    io.write_output("deepspeed_config", config)


run_stage(
    main,
    snakemake=smk,
    doc=__doc__,
    inputs=["plan"],
    outputs=["deepspeed_config"],
    sections={"deepspeed": "deepspeed", "training": STAGE},
)
