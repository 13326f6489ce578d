"""consolidate: model/<stage>/, a Hugging Face folder of the stage's final checkpoint, verified by reloading it.

Snakemake runs it through the `consolidate` rule (wildcard: stage); on its own:
    python scripts/consolidate.py --config config/config.yaml --stage pretrain \
        --summary results/tiny/pretrain/summary.json --tokenizer results/tiny/tokenizer \
        --model-config results/tiny/model_config.json --meta results/tiny/data/meta.json \
        --val results/tiny/data/val.bin --model results/tiny/model/pretrain
"""

import logging
from pathlib import Path

from stagetrain.config.settings import ConsolidateSettings, TrackingSettings
from stagetrain.consolidate.folder import consolidate
from stagetrain.io import read_json
from stagetrain.training import mlflow_run
from stagetrain.workflow.stage import StageIO, run_stage, training_stage

log = logging.getLogger("stagetrain")
smk = globals().get("snakemake")
STAGE = training_stage(smk)


def main(io: StageIO) -> None:
    tracking = TrackingSettings.from_config(io.sections["tracking"], "tracking")
    if "mlflow" in tracking.report_to:  # before the work: an unreachable server is one line now
        mlflow_run.check(tracking.mlflow)
    manifest = consolidate(
        stage=STAGE,
        summary_path=io.inputs["summary"],
        tokenizer_dir=io.inputs["tokenizer"],
        model_config_path=io.inputs["model_config"],
        meta_path=io.inputs["meta"],
        out=io.outputs["model"],
        cfg=ConsolidateSettings.from_config(io.sections["consolidate"], "consolidate"),
    )
    size = sum(f["bytes"] for name, f in manifest["files"].items() if name.endswith(".safetensors"))
    log.info("%s: step %d as %s, %.1f MB of weights in %s", STAGE, manifest["step"], manifest["dtype"],
             size / 1e6, io.outputs["model"])  # fmt: skip
    if "mlflow" in tracking.report_to:
        name = f"{Path(io.outputs['model']).resolve().parents[1].name}-{STAGE}"
        checkpoints = Path(read_json(io.inputs["summary"])["checkpoint"]["folder"])
        mlflow_run.log_model(tracking.mlflow, name, mlflow_run.run_key(name, checkpoints),
                             Path(io.outputs["model"]))  # fmt: skip


run_stage(
    main,
    snakemake=smk,
    doc=__doc__,
    inputs=["summary", "tokenizer", "model_config", "meta", "val"],
    outputs=["model"],
    sections=["consolidate", "tracking"],
)
