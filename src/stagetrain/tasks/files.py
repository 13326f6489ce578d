"""Rows of a data file: JSON lines (plain, gzip or zstandard) or parquet, chosen by suffix.

The one reader of the task families' files (`read_rows`) and of the corpus's
(`read_texts`, one text field of each row). Each row comes with where it is
('tasks/sort.parquet:row 12', 'x.jsonl.gz:3') so that every later complaint about
it names the file and the row. Parquet is read with pyarrow and zstandard streams
with the zstandard package (both maintained readers; Python's own gzip covers
.gz). Files stream, a line or a record batch at a time; a corpus's parquet file is
read one column, in batches of `TEXT_BATCH_ROWS`, so memory does not grow with it.
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
TEXT_BATCH_ROWS = 1024
"""Rows of a corpus parquet file decoded at once: at 10 KB a document, 10 MB."""


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


def read_texts(path: str | Path, field: str, shown: str | None = None) -> Iterator[tuple[str, str]]:
    """(where, text) of `field` in every row of a data file, in file order: a corpus file's
    documents. A row without the field, or with something else than text in it, is one line
    naming the file, the row and what it has."""
    path, shown = Path(path), shown or str(path)
    if suffix_of(path) == ".parquet":
        yield from _parquet_texts(path, shown, field)
        return
    for where, row in read_rows(path, shown):
        if field not in row:
            has = ", ".join(sorted(row)) or "no fields"
            raise StageError(
                f"{where}: no field {field!r} (it has: {has}); set text_field to the one that holds the text"
            )
        text = row[field]
        if not isinstance(text, str):
            raise StageError(f"{where}: field {field!r} holds {type(text).__name__}, not text")
        yield where, text


def _parquet_texts(path: Path, shown: str, field: str) -> Iterator[tuple[str, str]]:
    import pyarrow
    import pyarrow.parquet as pq
    import pyarrow.types as types

    try:
        handle = pq.ParquetFile(path)
        schema = handle.schema_arrow
        if field not in schema.names:
            raise StageError(
                f"{shown}: no column {field!r} (it has: {', '.join(schema.names)}); "
                "set text_field to the one that holds the text"
            )
        kind = schema.field(field).type
        if not (types.is_string(kind) or types.is_large_string(kind)):
            raise StageError(f"{shown}: column {field!r} holds {kind}, not text (a string column)")
        number = 0
        for batch in handle.iter_batches(batch_size=TEXT_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                number += 1
                if text is None:
                    raise StageError(f"{shown}:row {number}: column {field!r} is null, not text")
                yield f"{shown}:row {number}", text
    except pyarrow.ArrowException as err:
        raise StageError(
            f"{shown}: not a readable parquet file ({str(err).splitlines()[0]})"
        ) from None
