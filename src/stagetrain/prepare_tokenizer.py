"""The prepare_tokenizer stage: tokenizer, token shards, meta file and model config, from the config.

All files are first written under temporary names and renamed at the end, meta
last, so a killed stage leaves no file that looks finished; a failed one (bad
input found mid-stream, a full disk) removes its temporary files.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from stagetrain.corpus import sources as corpus_sources
from stagetrain.corpus.shards import sha256_file, token_dtype, write_split
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, atomic_write_text
from stagetrain.model_config import training_config
from stagetrain.tasks.families import load_tasks
from stagetrain.tokenizer import load_pretrained, save, train_bpe

log = logging.getLogger("stagetrain")


def training_sample(sources: list[corpus_sources.Source], megabytes: float) -> Iterator[str]:
    """Training-split documents for the BPE, each source giving its weight's share of the bytes."""
    weights = sum(s.weight for s in sources)
    for source in sources:
        budget, used = megabytes * 1e6 * source.weight / weights, 0
        for document in source.documents("train"):
            yield document
            used += len(document.encode("utf-8"))
            if used >= budget:
                break


def make_tokenizer(
    cfg: Mapping[str, Any], sources: list[corpus_sources.Source]
) -> PreTrainedTokenizerBase:
    """Train or load the tokenizer, and check it against the vocabulary the planner counted."""
    if cfg["source"] == "train":
        tokenizer = train_bpe(
            training_sample(sources, cfg["training_sample_mb"]), cfg["vocab_size"]
        )
    else:
        tokenizer = load_pretrained(cfg)
    if len(tokenizer) > cfg["vocab_size"]:
        raise StageError(
            f"tokenizer.vocab_size: {cfg['vocab_size']}, but the tokenizer has {len(tokenizer)} tokens "
            "with its special tokens; raise it (the planner counts this many embedding rows)"
        )
    return tokenizer


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn a full disk while writing `path` into one line naming it."""
    try:
        yield
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise StageError(f"no space left on {path.parent} (writing {path.name})") from None
        raise


@contextmanager
def _staged(paths: Mapping[str, Path]) -> Iterator[dict[str, Path]]:
    """Temp names beside `paths`, renamed over them when the block succeeds, removed when it fails.

    A failed stage (a bad line found mid-stream, a full disk) must not leave a partial
    temp file behind: on a full disk it is what fills it.
    """
    tmps = {key: path.with_name(f".{path.name}.tmp") for key, path in paths.items()}
    try:
        yield tmps
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    for key, path in paths.items():
        os.replace(tmps[key], path)


def _meta(
    tokenizer: Any,
    config: Any,
    tokenizer_hash: str,
    special: Mapping[str, int],
    dtype: np.dtype,
    sources: Sequence[Any],
    shards: Mapping[str, Path],
    written: Mapping[str, Sequence[Any]],
) -> dict[str, Any]:
    """data/meta.json: the token dtype, tokenizer and vocabulary, each split's totals and
    hash, and each source's share of each split."""
    return {
        "dtype": dtype.name,
        "tokenizer_size": len(tokenizer),
        "model_vocab_size": config.vocab_size,
        "tokenizer_sha256": tokenizer_hash,
        **special,
        **{
            split: {
                "tokens": sum(w.tokens for w in written[split]),
                "documents": sum(w.documents for w in written[split]),
                "sha256": sha256_file(path),
            }
            for split, path in shards.items()
        },
        "sources": [
            {
                "name": source.name,
                "weight": source.weight,
                "record": source.record,
                **{f"{split}_tokens": written[split][i].tokens for split in shards},
                **{f"{split}_documents": written[split][i].documents for split in shards},
            }
            for i, source in enumerate(sources)
        ],
    }


def prepare(
    *,
    run: Mapping[str, Any],
    model: Mapping[str, Any],
    tokenizer_cfg: Mapping[str, Any],
    data: Mapping[str, Any],
    tp: int,
    tasks: Mapping[str, Any] | None = None,
    outputs: Mapping[str, str],
) -> dict[str, Any]:
    """Write every output of the stage; return data/meta.json's content.

    `tp` is plan/vocab.json's: the padded vocabulary must divide by it. Every family of the
    `tasks` section (default: none beyond the built-in ones) is loaded and checked here, those
    the corpus does not hold too: a bad task file stops the first stage, not GRPO after
    pretraining.
    """
    sources = corpus_sources.build(data, run["seed"], load_tasks(tasks or {}))
    tokenizer = make_tokenizer(tokenizer_cfg, sources)
    special = {
        f"{k}_id": getattr(tokenizer, f"{k}_id") for k in ("bos_token", "eos_token", "pad_token")
    }
    config = training_config(model, tokenizer_size=len(tokenizer), special_ids=special, tp=tp)
    log.info("tokenizer: %d tokens; model vocabulary %d (multiple of %d)", len(tokenizer), config.vocab_size,
             model["vocab_multiple"] * tp)  # fmt: skip

    dtype = token_dtype(len(tokenizer))
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.eos_token_id
    shards = {split: Path(outputs[split]) for split in ("train", "val")}
    written = {}
    with _staged(shards) as tmps:
        for split, path in shards.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            total = data[f"{split}_tokens"]
            with _writing(path):
                written[split] = write_split(backend, sources, split, total, tmps[split],
                                             eos_id=eos, dtype=dtype)  # fmt: skip
            log.info("%s: %d tokens in %d documents", split, sum(w.tokens for w in written[split]),
                     sum(w.documents for w in written[split]))  # fmt: skip
        with _writing(Path(outputs["tokenizer"])):
            tokenizer_hash = save(tokenizer, Path(outputs["tokenizer"]))
        with _writing(Path(outputs["model_config"])):
            atomic_write_text(outputs["model_config"], config.to_json_string(use_diff=False))
    meta = _meta(tokenizer, config, tokenizer_hash, special, dtype, sources, shards, written)
    with _writing(Path(outputs["meta"])):
        atomic_write_json(outputs["meta"], meta)
    return meta
