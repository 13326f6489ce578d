"""Benchmark: shard writing throughput against a bare encode_batch loop, and memory against corpus size.

    python benchmarks/tokenize_speed.py

1. The same pre-generated documents are tokenised twice in this process: by a
   bare `Tokenizer.encode_batch` loop (the baseline, output discarded) and by
   `write_documents` (which also builds the token arrays and writes the file).
   It prints both rates and their ratio (target: at least 0.8). Run order
   alternates over three rounds and the best of each is kept.
2. Peak resident memory of the whole prepare step (generation, tokenisation,
   writing) for 1x and 4x the tokens, each in a fresh process: flat memory
   means the two peaks are about equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import DataSettings
from stagetrain.corpus import sources as corpus_sources
from stagetrain.corpus.shards import BATCH_DOCUMENTS, write_documents
from stagetrain.tokenizer.build import train_bpe
from stagetrain.tokenizer.prepare import training_sample

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = 200_000


def _bare(tokenizer, docs: list[str]) -> int:
    tokens = 0
    for start in range(0, len(docs), BATCH_DOCUMENTS):
        for encoding in tokenizer.encode_batch(
            docs[start : start + BATCH_DOCUMENTS], add_special_tokens=False
        ):
            tokens += len(encoding.ids)
    return tokens


def throughput() -> None:
    cfg = stconfig.load(REPO / "config" / "config.yaml")
    sources = corpus_sources.build(DataSettings.from_config(cfg["data"], "data"), seed=1)
    hf = train_bpe(training_sample(sources, 1.0), cfg["tokenizer"]["vocab_size"])
    backend = hf.backend_tokenizer
    docs = [d for _, d in zip(range(DOCUMENTS), sources[0].documents("train"), strict=False)]
    best_bare, best_ours = float("inf"), float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(3):
            start = time.perf_counter()
            bare_tokens = _bare(backend, docs)
            best_bare = min(best_bare, time.perf_counter() - start)
            start = time.perf_counter()
            with open(Path(tmp) / "train.bin", "wb") as out:
                written = write_documents(
                    backend,
                    iter(docs),
                    10**12,
                    out,
                    eos_id=hf.eos_token_id,
                    dtype=np.dtype(np.uint16),
                )
            best_ours = min(best_ours, time.perf_counter() - start)
    bare_rate = bare_tokens / best_bare
    ours_rate = (
        written.tokens - written.documents
    ) / best_ours  # count text tokens only, as the baseline does
    print(f"{len(docs):,} documents, {bare_tokens:,} tokens")
    print(f"bare encode_batch loop: {bare_rate:,.0f} tokens/s")
    print(f"write_documents:        {ours_rate:,.0f} tokens/s")
    print(f"ratio (target >= 0.8):  {ours_rate / bare_rate:.2f}")


PREPARE = """
import json, resource, sys, time
from pathlib import Path
from stagetrain.config import validation as stconfig
from stagetrain.tokenizer.prepare import prepare

def merge(into, changes):
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value

changes, out = json.loads(sys.argv[1]), Path(sys.argv[2])
cfg = stconfig.load("config/config.yaml")
merge(cfg, changes)
names = {"tokenizer": "tokenizer", "train": "train.bin", "val": "val.bin", "meta": "meta.json", "model_config": "model_config.json"}
start = time.perf_counter()
prepare(cfg, tp=1, outputs={k: str(out / v) for k, v in names.items()})
seconds = time.perf_counter() - start
tokens = sum((out / f).stat().st_size for f in ("train.bin", "val.bin")) // 2
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds, "tokens": tokens}))
"""


def run_prepare(changes: dict, out: Path) -> dict[str, float]:
    """The whole tokenizer stage on the default config with `changes` (section -> keys, merged),
    in a fresh process writing into `out`: its peak MiB, seconds and tokens written."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", PREPARE, json.dumps(changes), str(out)], cwd=REPO,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_memory() -> None:
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (2_000_000, 8_000_000):
            changes = {"data": {"train_tokens": tokens}, "tokenizer": {"training_sample_mb": 1}}
            peaks[tokens] = run_prepare(changes, Path(tmp) / str(tokens))["peak_mib"]
            print(f"prepare with {tokens:,} train tokens: peak RSS {peaks[tokens]:.0f} MiB")
    print(
        f"ratio 4x tokens / 1x tokens: {peaks[8_000_000] / peaks[2_000_000]:.2f} (flat memory: about 1)"
    )


if __name__ == "__main__":
    throughput()
    peak_memory()
