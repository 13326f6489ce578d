"""Resizing a model's embeddings to the padded vocabulary, before DeepSpeed wraps it.

The training stages build the model from model_config.json (whose vocabulary is
already padded) or load `init_from` weights with fewer rows; this grows the
input embedding and the output projection to the config's size. It relies on
transformers' `resize_token_embeddings(mean_resizing=True)`: rows that existed
keep their values, new rows are drawn around the mean of the old ones with
their covariance (so new tokens start with ordinary logits), tied weights stay
tied, and under ZeRO-3 the partitioned old weights are gathered to be copied.
That path is only taken while an `HfDeepSpeedConfig` for a ZeRO-3 config is
alive, which the training stages hold while building the model; a partitioned
model without one is refused rather than corrupted.

Memory: transformers builds the grown embedding as an ordinary tensor, so
under ZeRO-3 every rank holds the whole embedding (not the whole model) until
`deepspeed.initialize` partitions it again. A from-scratch model is built with
the padded vocabulary already and never resizes; only `init_from` models do.

Resizing after `deepspeed.initialize` would leave the optimizer holding the old
tensors, so a wrapped engine is refused too.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled

from stagetrain.errors import StageError


def embedding_rows(model: PreTrainedModel) -> int:
    """Rows of the input embedding, also when ZeRO-3 has partitioned it (ds_shape)."""
    weight = model.get_input_embeddings().weight
    shape = getattr(weight, "ds_shape", None) or weight.shape
    return int(shape[0])


def resize_embeddings(model: PreTrainedModel, vocab_size: int, *, seed: int) -> bool:
    """Grow `model`'s input and output embeddings to `vocab_size` rows; return whether it changed.

    Call it on every rank, after building the model and before deepspeed.initialize.

    Raises:
        StageError: the model is already wrapped by DeepSpeed, is partitioned
            without a live ZeRO-3 HfDeepSpeedConfig, or has more rows than asked.
    """
    if not isinstance(model, PreTrainedModel):
        raise StageError(
            f"resize_embeddings: expected an unwrapped transformers model, got {type(model).__name__} "
            "(resize before deepspeed.initialize)"
        )
    rows = embedding_rows(model)
    if rows == vocab_size:
        return False
    if rows > vocab_size:
        raise StageError(
            f"resize_embeddings: the model has {rows} rows, more than the {vocab_size} asked"
        )
    partitioned = hasattr(model.get_input_embeddings().weight, "ds_id")
    if partitioned and not is_deepspeed_zero3_enabled():
        raise StageError(
            "resize_embeddings: the model is ZeRO-3 partitioned but no HfDeepSpeedConfig is alive; "
            "build and resize it while one is"
        )
    # Ranks must draw the same new rows (ZeRO-3 takes rank 0's; otherwise each rank draws its own).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(vocab_size, mean_resizing=True)
    model.config.vocab_size = vocab_size
    return True
