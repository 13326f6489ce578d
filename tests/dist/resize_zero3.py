"""Two-rank ZeRO-3 check of `resize_embeddings`, started by tests/test_embeddings.py.

Usage: torchrun --standalone --nproc_per_node 2 tests/dist/resize_zero3.py OUT_DIR TIED(0|1)

Each rank builds the default tiny Llama (300 rows) under deepspeed.zero.Init (through a live
HfDeepSpeedConfig, as the training stages do), records how much of the embedding it holds,
gathers the old weights, resizes to 320 rows, gathers the new weights, wraps the model with
deepspeed.initialize and takes one AdamW step on a batch that uses the new rows. Then it
builds a second partitioned model, lets the HfDeepSpeedConfig die and records how
`resize_embeddings` refuses it. Everything goes to OUT_DIR/rank{R}.json and OUT_DIR/rank{R}.pt;
the test asserts on those files.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

from stagetrain.config.settings import ModelSettings
from stagetrain.config.validation import load
from stagetrain.errors import StageError
from stagetrain.model.config import build_config
from stagetrain.model.embeddings import embedding_rows, resize_embeddings
from stagetrain.training.engine import skip_inference_comm_op

OLD_ROWS, NEW_ROWS, SEED = 300, 320, 4321
# Ids below and above 300: the step must run through old and new rows.
BATCH = [[1, 17, 299, 300, 305, 311, 319, 42, 318, 2]]


def ds_config() -> dict[str, Any]:
    """ZeRO-3 in fp32 (exact comparisons), one sequence per rank, torch's AdamW."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }


def build(tied: bool) -> PreTrainedModel:
    """The default tiny model with OLD_ROWS rows, built with the same seed on every rank."""
    section = {
        **load(Path(__file__).resolve().parents[2] / "config" / "config.yaml")["model"],
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        build_config(ModelSettings.from_config(section, "model"), OLD_ROWS)
    )


def gathered(param: torch.nn.Parameter) -> torch.Tensor:
    """A full copy of `param` on this rank (a no-op gather when it is not partitioned)."""
    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()


def partition(param: torch.nn.Parameter) -> dict[str, Any]:
    """How much of `param` this rank holds."""
    if not hasattr(param, "ds_id"):
        return {"partitioned": False, "local": param.numel(), "total": param.numel()}
    return {
        "partitioned": True,
        "local": param.ds_tensor.numel(),
        "total": param.ds_numel,
        "shape": list(param.ds_shape),
        "visible_numel": param.numel(),  # 0 outside a gather
    }


def main(out: Path, tied: bool) -> None:
    skip_inference_comm_op()  # as the stages do
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = ds_config()
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "tied": tied}
    tensors: dict[str, torch.Tensor] = {}

    dschf = HfDeepSpeedConfig(config)  # kept alive: transformers reads it through a weakref
    record["zero3_enabled"] = is_deepspeed_zero3_enabled()
    model = build(tied)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    record["built"] = {"input": partition(emb), "output": partition(head)}
    record["built_tied"] = head is emb
    record["rows_before"] = embedding_rows(model)
    tensors["old_input"] = gathered(emb)
    tensors["old_output"] = gathered(head)

    record["changed"] = resize_embeddings(model, NEW_ROWS, seed=SEED)
    record["rows_after"] = embedding_rows(model)
    record["config_vocab_size"] = model.config.vocab_size
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    record["tied_after"] = head is emb
    record["resized"] = {"input": partition(emb), "output": partition(head)}
    record["lm_head_out_features"] = model.get_output_embeddings().out_features
    tensors["new_input"] = gathered(emb)
    tensors["new_output"] = gathered(head)

    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    record["wrapped"] = {"input": partition(emb), "output": partition(head)}
    record["tied_wrapped"] = head is emb
    tensors["wrapped_input"] = gathered(emb)
    tensors["wrapped_output"] = gathered(head)

    ids = torch.tensor(BATCH)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    record["loss"] = loss.item()
    tensors["stepped_input"] = gathered(emb)

    try:
        resize_embeddings(engine, NEW_ROWS + 64, seed=SEED)
        record["engine_refused"] = None
    except StageError as err:
        record["engine_refused"] = str(err)

    # A partitioned model whose HfDeepSpeedConfig is gone: resizing would write only local
    # copies, so it must be refused, and the model left as it was.
    orphan = build(tied)
    del dschf
    gc.collect()
    record["zero3_enabled_after_del"] = is_deepspeed_zero3_enabled()
    try:
        resize_embeddings(orphan, NEW_ROWS, seed=SEED)
        record["orphan_refused"] = None
    except StageError as err:
        record["orphan_refused"] = str(err)
    record["orphan_rows"] = embedding_rows(orphan)
    record["orphan_partitioned"] = hasattr(orphan.get_input_embeddings().weight, "ds_id")

    # Built under a bare zero.Init, never with an HfDeepSpeedConfig: refused the same way.
    with deepspeed.zero.Init(config_dict_or_path=config):
        bare = build(tied)
    record["bare_partitioned"] = hasattr(bare.get_input_embeddings().weight, "ds_id")
    try:
        resize_embeddings(bare, NEW_ROWS, seed=SEED)
        record["bare_refused"] = None
    except StageError as err:
        record["bare_refused"] = str(err)
    record["bare_rows"] = embedding_rows(bare)

    torch.save(tensors, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "1")
