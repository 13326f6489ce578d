"""Benchmark: the tokenizer stage on a parquet corpus of 2 GB against one of 200 MB: memory, and speed.

    python -m benchmarks.corpus_memory [--large-gb 2.0] [--small-gb 0.2] [--row-groups 4] [--keep DIR]

Run from the repository root. Both corpora are written on the fly (parquet, row groups of
8,192 documents of 200-6,000 characters of word-like text), then:

1. The whole stage (`prepare_tokenizer.prepare`: BPE training on its sample, the train and val
   shards, the tokenizer and model config), once per corpus, each in a fresh process, with
   `data.train_tokens` above what the corpus holds, so that every document is read: its peak
   resident memory (ru_maxrss) and wall time. Flat memory means the two peaks are about equal
   (goal: large / small <= 1.2).
2. On the small corpus's first row groups (`--row-groups`), in one process and with the
   tokenizer the stage trained: the stage's own train-shard writer (`write_split` over the
   corpus's file source) against a bare loop of pyarrow `iter_batches` and
   `encode_batch_fast` over the same row groups, output discarded (goal: stage / bare >= 0.8),
   best of two alternating rounds.

Prints each figure and the ratios; the last line is a JSON object with them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.tokenize_speed import run_prepare

ROW_GROUP = 8192
SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou", "ai")]
WORDS = [
    "".join(random.Random(i).choices(SYLLABLES, k=1 + i.bit_length() // 4)) for i in range(30_000)
]
"""A vocabulary of word-like strings, the frequent ones short."""
CUMULATIVE = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(WORDS))))
"""Zipf's law over WORDS, as word frequencies in text follow it (a flat choice of random
letter strings tokenised at 2 bytes a token, text at about 4-5)."""


def write_corpus(path: Path, gigabytes: float, seed: int) -> int:
    """A parquet file of at least `gigabytes` of text in row groups of ROW_GROUP documents; the
    text's bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, target, written = random.Random(seed), int(gigabytes * 1e9), 0
    schema = pa.schema([("text", pa.string()), ("id", pa.int64())])
    with pq.ParquetWriter(path, schema) as out:
        while written < target:
            docs = []
            for _ in range(ROW_GROUP):
                words = rng.choices(WORDS, cum_weights=CUMULATIVE, k=rng.randint(30, 900))
                for at in range(rng.randint(1, 12), len(words), rng.randint(8, 20)):
                    words[at] += "."
                docs.append(" ".join(words))
            written += sum(len(d.encode()) for d in docs)
            table = pa.table(
                {"text": docs, "id": range(written, written + len(docs))}, schema=schema
            )
            out.write_table(table, row_group_size=ROW_GROUP)
    return written


def _reads_all(corpus: Path) -> dict:
    """The config changes under which the stage reads every row of `corpus` and nothing else:
    train_tokens above what it holds, a 1% val share, no generated corpus."""
    return {
        "data": {"train_tokens": 2 * 10**12, "val_tokens": 2 * 10**10, "generated": {"weight": 0},
                 "files": [{"path": str(corpus), "weight": 1.0, "text_field": "text"}]},
        "tokenizer": {"vocab_size": 4096, "training_sample_mb": 8},
    }  # fmt: skip


def throughput(corpus: Path, tokenizer_dir: Path, row_groups: int) -> dict[str, float]:
    """Tokens/s of the stage's train-shard writer and of a bare pyarrow + encode_batch_fast loop
    over the same first `row_groups` row groups of `corpus`, best of two alternating rounds. The
    writer gets the bare loop's token count as its budget, so it reads the same documents."""
    import numpy as np
    import pyarrow.parquet as pq
    from transformers import PreTrainedTokenizerFast

    from stagetrain.config.settings import FileData
    from stagetrain.corpus.shards import write_split
    from stagetrain.corpus.sources import files

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    source = files(FileData(path=str(corpus), weight=1.0, text_field="text"), 0, 0.0)

    def bare() -> tuple[int, int]:
        tokens = documents = 0
        batches = pq.ParquetFile(corpus).iter_batches(batch_size=ROW_GROUP, columns=["text"])
        for batch in itertools.islice(batches, row_groups):
            texts = batch.column(0).to_pylist()
            tokens += sum(
                len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False)
            )
            documents += len(texts)
        return tokens, documents

    def stage(out: Path, budget: int) -> tuple[int, int]:
        written = write_split(backend, [source], "train", budget, out,
                              eos_id=tokenizer.eos_token_id, dtype=np.dtype(np.uint16))  # fmt: skip
        documents = sum(w.documents for w in written)
        return sum(w.tokens for w in written) - documents, documents  # text tokens, as bare counts

    best = {"bare": float("inf"), "stage": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(2):
            start = time.perf_counter()
            tokens, documents = bare()
            best["bare"] = min(best["bare"], time.perf_counter() - start)
            start = time.perf_counter()
            same = stage(Path(tmp) / "train.bin", tokens + documents)
            best["stage"] = min(best["stage"], time.perf_counter() - start)
            assert same == (tokens, documents), (same, tokens, documents)
    return {name: tokens / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--small-gb", type=float, default=0.2)
    parser.add_argument(
        "--row-groups", type=int, default=4, help="of the small corpus, timed for speed"
    )
    parser.add_argument(
        "--keep", type=Path, help="write the corpora and outputs here, and keep them"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        results: dict[str, dict[str, float]] = {}
        for name, gigabytes, seed in (("small", args.small_gb, 1), ("large", args.large_gb, 2)):
            corpus = root / f"{name}.parquet"
            start = time.perf_counter()
            text = write_corpus(corpus, gigabytes, seed)
            print(f"{name}: {text / 1e9:.2f} GB of text, {corpus.stat().st_size / 1e9:.2f} GB of parquet, "
                  f"written in {time.perf_counter() - start:.0f} s")  # fmt: skip
            results[name] = {"text_gb": text / 1e9, "parquet_gb": corpus.stat().st_size / 1e9,
                             **run_prepare(_reads_all(corpus), root / name)}  # fmt: skip
            r = results[name]
            print(
                f"{name}: prepare read {r['tokens']:,} tokens in {r['seconds']:.0f} s, peak RSS {r['peak_mib']:.0f} MiB"
            )
        rates = throughput(root / "small.parquet", root / "small" / "tokenizer", args.row_groups)
    memory = results["large"]["peak_mib"] / results["small"]["peak_mib"]
    speed = rates["stage"] / rates["bare"]
    print(f"peak RSS large / small: {memory:.2f} (goal <= 1.2)")
    print(
        f"train shard writer: {rates['stage']:,.0f} tokens/s; bare pyarrow + encode_batch_fast: {rates['bare']:,.0f}"
    )
    print(f"ratio stage / bare: {speed:.2f} (goal >= 0.8)")
    print(
        json.dumps({**results, "tokens_per_s": rates, "memory_ratio": memory, "speed_ratio": speed})
    )


if __name__ == "__main__":
    main()
