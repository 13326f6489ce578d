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
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from stagetrain.config.settings import (
    DataSettings,
    ModelSettings,
    RunSettings,
    TasksSettings,
    TokenizerSettings,
)
from stagetrain.corpus import sources as corpus_sources
from stagetrain.corpus.meta import (
    SourceShare,
    SpecialIds,
    SplitTotals,
    TokenizerMeta,
)
from stagetrain.corpus.shards import Written, sha256_file, token_dtype, write_split
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, atomic_write_text
from stagetrain.model.config import training_config
from stagetrain.tasks.families import NO_TASKS, load_tasks
from stagetrain.tokenizer.build import load_pretrained, save, train_bpe

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
    cfg: TokenizerSettings, sources: list[corpus_sources.Source]
) -> PreTrainedTokenizerBase:
    """Train or load the tokenizer, and check it against the vocabulary the planner counted."""
    if cfg.source == "train":
        tokenizer = train_bpe(training_sample(sources, cfg.training_sample_mb), cfg.vocab_size)
    else:
        tokenizer = load_pretrained(cfg)
    if len(tokenizer) > cfg.vocab_size:
        raise StageError(
            f"tokenizer.vocab_size: {cfg.vocab_size}, but the tokenizer has {len(tokenizer)} tokens "
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
def _staged(
    paths: Mapping[corpus_sources.Split, Path],
) -> Iterator[dict[corpus_sources.Split, Path]]:
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
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig,
    tokenizer_hash: str,
    special: SpecialIds,
    dtype: np.dtype,
    sources: Sequence[corpus_sources.Source],
    shards: Mapping[corpus_sources.Split, Path],
    written: Mapping[corpus_sources.Split, Sequence[Written]],
) -> TokenizerMeta:
    """data/meta.json: the token dtype, tokenizer and vocabulary, each split's totals and
    hash, and each source's share of each split."""

    def totals(split: corpus_sources.Split) -> SplitTotals:
        return SplitTotals(tokens=sum(w.tokens for w in written[split]),
                           documents=sum(w.documents for w in written[split]),
                           sha256=sha256_file(shards[split]))  # fmt: skip

    shares = [
        SourceShare(
            name=source.name,
            weight=source.weight,
            record=source.record,
            train_tokens=written["train"][i].tokens,
            val_tokens=written["val"][i].tokens,
            train_documents=written["train"][i].documents,
            val_documents=written["val"][i].documents,
            train_repeats=written["train"][i].repeats,
            val_repeats=written["val"][i].repeats,
        )
        for i, source in enumerate(sources)
    ]
    return TokenizerMeta(dtype=dtype.name, tokenizer_size=len(tokenizer), model_vocab_size=config.vocab_size,
                         tokenizer_sha256=tokenizer_hash, bos_token_id=special["bos_token_id"],
                         eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"],
                         train=totals("train"), val=totals("val"), sources=shares)  # fmt: skip


def prepare(
    sections: Mapping[str, Mapping[str, Any]], *, tp: int, outputs: Mapping[str, str]
) -> TokenizerMeta:
    """Write every output of the stage; return data/meta.json's content.

    `sections`: the validated run, model, tokenizer, data and (optionally) tasks sections, as
    the stage script gets them (a whole validated config does too), built into their settings
    here. `tp` is plan/vocab.json's: the padded vocabulary must divide by it. Every family of
    the tasks section (none: the built-in ones) is loaded and checked here, those the corpus
    does not hold too: a bad task file stops the first stage, not GRPO after pretraining.
    """
    run = RunSettings.from_config(sections["run"], "run")
    model = ModelSettings.from_config(sections["model"], "model")
    tasks = sections.get("tasks")
    tasks_settings = NO_TASKS if tasks is None else TasksSettings.from_config(tasks, "tasks")
    data = DataSettings.from_config(sections["data"], "data")
    sources = corpus_sources.build(data, run.seed, load_tasks(tasks_settings))
    tokenizer = make_tokenizer(
        TokenizerSettings.from_config(sections["tokenizer"], "tokenizer"), sources
    )
    special = SpecialIds(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    config = training_config(model, tokenizer_size=len(tokenizer), special_ids=special, tp=tp)
    log.info("tokenizer: %d tokens; model vocabulary %d (multiple of %d)", len(tokenizer), config.vocab_size,
             model.vocab_multiple * tp)  # fmt: skip
    return _write(tokenizer, config, special, sources, data, outputs)


def _write(
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig,
    special: SpecialIds,
    sources: Sequence[corpus_sources.Source],
    data: DataSettings,
    outputs: Mapping[str, str],
) -> TokenizerMeta:
    """The shards, the tokenizer folder and the model config, renamed into place together,
    then data/meta.json (last, so a killed stage leaves no finished-looking meta)."""
    dtype = token_dtype(len(tokenizer))
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.eos_token_id
    shards: dict[corpus_sources.Split, Path] = {
        split: Path(outputs[split]) for split in ("train", "val")
    }
    totals: dict[corpus_sources.Split, int] = {"train": data.train_tokens, "val": data.val_tokens}
    written: dict[corpus_sources.Split, list[Written]] = {}
    with _staged(shards) as tmps:
        for split, path in shards.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with _writing(path):
                written[split] = write_split(backend, sources, split, totals[split], tmps[split],
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
