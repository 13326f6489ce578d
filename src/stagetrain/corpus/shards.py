"""Streaming tokenisation of the corpus into flat token files (nanoGPT's train.bin / val.bin).

Documents are encoded in batches by the Rust tokenizer (`encode_batch_fast`,
parallel over the cores) and appended to the file as they come, each followed by
the eos token, so memory holds one batch whatever the corpus size. The dtype is
uint16 when every id fits, else uint32; it is chosen by a check, not assumed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tokenizers import Tokenizer

from stagetrain.corpus.sources import Source, Split
from stagetrain.errors import StageError

log = logging.getLogger("stagetrain")

MAX_PASSES = 100
"""The most times a source's documents are read to fill its share of a split: past that its
weight asks for a corpus that is mostly one small file over and over, which is refused."""
BATCH_DOCUMENTS = 4096
PROGRESS_EVERY_S = 5.0


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 if every id of a `vocab_size` vocabulary fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass(kw_only=True, slots=True)
class Written:
    """What one source contributed to one split."""

    tokens: int = 0
    documents: int = 0
    repeats: int = 0
    """Times the source's documents were started over to fill its share."""


class _Progress:
    """Logs tokens written, tokens/s and the ETA every few seconds."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start, self.last = total, 0, time.monotonic(), time.monotonic()

    def add(self, tokens: int) -> None:
        self.done += tokens
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.done / (now - self.start)
            eta = (self.total - self.done) / rate if rate else float("inf")
            log.info(
                "tokenised %d / %d tokens, %.0f tokens/s, ETA %.0f s",
                self.done,
                self.total,
                rate,
                eta,
            )


def write_documents(
    tokenizer: Tokenizer,
    documents: Iterator[str],
    budget: int,
    out: BinaryIO,
    *,
    eos_id: int,
    dtype: np.dtype,
    progress: _Progress | None = None,
) -> Written:
    """Encode whole documents into `out` until at least `budget` tokens are written or they run out."""
    written = Written()
    while written.tokens < budget:
        batch = list(islice(documents, BATCH_DOCUMENTS))
        if not batch:
            break
        ids = []
        for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            ids.append(encoding.ids)
            ids.append([eos_id])
            written.documents += 1
            written.tokens += len(encoding.ids) + 1
            if written.tokens >= budget:
                break
        chunk = np.fromiter(chain.from_iterable(ids), dtype=dtype)
        out.write(chunk.data)  # not tofile: its OSError on a full disk carries no errno
        if progress:
            progress.add(len(chunk))
    return written


def write_split(
    tokenizer: Tokenizer,
    sources: Sequence[Source],
    split: Split,
    total: int,
    path: Path,
    *,
    eos_id: int,
    dtype: np.dtype,
) -> list[Written]:
    """Write one split from every source, each taking its weight's share of `total` tokens. A
    source whose documents run out first is read again from its start, as many times as its
    share needs, and a log line says so: stopping short made the weights mean less than they say
    (a file of 1,000 tokens at weight 1 beside the generated corpus at weight 1 was 1,000 of
    the split's tokens, not half), and the split smaller than the config asked."""
    weights = sum(s.weight for s in sources)
    progress = _Progress(total)
    with open(path, "wb") as out:
        written = []
        for source in sources:
            # A corpus file's "<|eos|>" is text, not the end of a document: special tokens are
            # matched only in the generated corpus, whose task markers are meant as markup.
            tokenizer.encode_special_tokens = not source.controls
            budget = round(total * source.weight / weights)
            done = Written()
            try:
                while done.tokens < budget:
                    part = write_documents(tokenizer, source.documents(split), budget - done.tokens,
                                           out, eos_id=eos_id, dtype=dtype, progress=progress)  # fmt: skip
                    if not part.tokens:  # nothing in this split at all
                        break
                    if (
                        not done.tokens
                        and part.tokens < budget
                        and budget / part.tokens > MAX_PASSES
                    ):
                        raise StageError(
                            f"{source.name}: its {split} documents hold {part.tokens:,} tokens, which would be read "
                            f"{math.ceil(budget / part.tokens):,} times for its share of {budget:,} (weight "
                            f"{source.weight:g}; at most {MAX_PASSES}); lower its weight or add documents"
                        )
                    done.repeats += bool(done.tokens)
                    done.tokens, done.documents = (
                        done.tokens + part.tokens,
                        done.documents + part.documents,
                    )
            finally:
                tokenizer.encode_special_tokens = False
            if done.repeats:
                log.info("%s %s: its documents were read %d times to fill its share of %d tokens (weight %g)",
                         source.name, split, done.repeats + 1, budget, source.weight)  # fmt: skip
            written.append(done)
        return written


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
