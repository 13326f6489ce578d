"""prepare_tokenizer: tokenizer/, data/train.bin, data/val.bin, data/meta.json, model_config.json.

Snakemake runs it through the `prepare_tokenizer` rule; on its own:
    python scripts/prepare_tokenizer.py --config config/config.yaml --vocab results/tiny/plan/vocab.json \
        --tokenizer results/tiny/tokenizer --train results/tiny/data/train.bin \
        --val results/tiny/data/val.bin --meta results/tiny/data/meta.json \
        --model-config results/tiny/model_config.json
"""

import logging

from stagetrain.tokenizer.prepare import prepare
from stagetrain.workflow.stage import StageIO, run_stage

log = logging.getLogger("stagetrain")


def main(io: StageIO) -> None:
    meta = prepare(io.sections, tp=io.read_input("vocab")["tp"], outputs=io.outputs)
    for source in meta["sources"]:
        log.info("source %s: %d train and %d val tokens", source["name"], source["train_tokens"],
                 source["val_tokens"])  # fmt: skip


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=["vocab"],
    outputs=["tokenizer", "train", "val", "meta", "model_config"],
    sections=["run", "model", "tokenizer", "data", "tasks"],
)
