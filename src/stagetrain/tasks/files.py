"""Rows of a task file: JSON lines (plain, gzip or zstandard) or parquet, chosen by suffix.

Each row comes with where it is ('tasks/sort.parquet:row 12', 'x.jsonl.gz:3') so
that every later complaint about it names the file and the row. Parquet is read
with pyarrow and zstandard streams with the zstandard package (both maintained
readers; Python's own gzip covers .gz). A file is read whole, one row group or
line at a time: task files are a question and an answer per row, thousands of
rows, not a corpus.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from stagetrain.errors import StageError
from stagetrain.io import json_lines

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def suffix_of(path: str | Path) -> str | None:
    """The task-file suffix `path` ends with, or None."""
    name = str(path)
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def read_rows(path: str | Path, shown: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a task file, in file order; `shown` is the name errors use
    (a hub file's repo and name rather than its cache path)."""
    path, shown = Path(path), shown or str(path)
    kind = suffix_of(path)
    if kind is None:
        raise StageError(f"{shown}: not a task file; expected one of {', '.join(SUFFIXES)}")
    if kind == ".parquet":
        yield from _parquet_rows(path, shown)
        return
    corrupt: tuple[type[Exception], ...] = (
        OSError,
        EOFError,
    )  # a truncated .gz, an unreadable file
    if kind == ".jsonl.zst":
        import zstandard

        corrupt += (zstandard.ZstdError,)
    try:
        with _opened(path, kind) as handle:
            yield from _json_lines(handle, shown)
    except corrupt as err:
        raise StageError(
            f"{shown}: cannot read ({getattr(err, 'strerror', None) or err})"
        ) from None


def _opened(path: Path, kind: str) -> IO[bytes]:
    if kind == ".jsonl.gz":
        return gzip.open(path, "rb")
    if kind == ".jsonl.zst":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115 - closed with the reader
        return io.BufferedReader(reader)  # lines: the bare reader reads only by size
    return open(path, "rb")


def _json_lines(handle: IO[bytes], shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, row in json_lines(handle, shown):
        if not isinstance(row, dict):
            raise StageError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _parquet_rows(path: Path, shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        number = 0
        for batch in table.iter_batches():
            for row in batch.to_pylist():
                number += 1
                yield f"{shown}:row {number}", row
    except pyarrow.ArrowException as err:
        raise StageError(
            f"{shown}: not a readable parquet file ({str(err).splitlines()[0]})"
        ) from None
