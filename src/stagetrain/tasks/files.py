"""Rows of a data file: JSON lines (plain, gzip or zstandard) or parquet, chosen by suffix.

The one reader of the task families' files (`read_rows`) and of the corpus's
(`read_texts`, one text field of each row). Each row comes with where it is
('tasks/sort.parquet:row 12', 'x.jsonl.gz:3') so that every later complaint about
it names the file and the row. Parquet is read with pyarrow and zstandard streams
with the zstandard package (both maintained readers; Python's own gzip covers
.gz). Files stream, a line or a record batch at a time; a corpus's parquet file is
read one column, in batches of `BATCH_ROWS`, so memory does not grow with it.
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
BATCH_ROWS = 1024
"""Rows of a parquet file decoded at once: at 10 KB a corpus document, 10 MB."""


def suffix_of(path: str | Path) -> str | None:
    """The task-file suffix `path` ends with, or None."""
    name = str(path)
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def read_rows(
    path: str | Path, shown: str | None = None, *, columns: list[str] | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a task file, in file order; `shown` is the name errors use
    (a hub file's repo and name rather than its cache path); `columns`: the only ones a parquet
    file is read for (JSON lines are parsed whole)."""
    path, shown = Path(path), shown or str(path)
    kind = suffix_of(path)
    if kind is None:
        raise StageError(f"{shown}: not a task file; expected one of {', '.join(SUFFIXES)}")
    if kind == ".parquet":
        yield from _parquet_rows(path, shown, columns)
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


def _parquet_rows(
    path: Path, shown: str, columns: list[str] | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        # pre_buffer (pyarrow's default) coalesces reads ahead and kept memory growing with the
        # file: prepare's peak RSS was 2.1x on 2 GB of text what it was on 200 MB, 1.03x without
        # (benchmarks/corpus_memory.py); the reads are sequential, so nothing is lost.
        table = pq.ParquetFile(path, pre_buffer=False)
        number = 0
        for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            for row in batch.to_pylist():
                number += 1
                yield f"{shown}:row {number}", row
    except pyarrow.ArrowException as err:
        raise _unreadable(shown, err) from None


def _unreadable(shown: str, err: Exception) -> StageError:
    return StageError(f"{shown}: not a readable parquet file ({str(err).splitlines()[0]})")


def read_texts(path: str | Path, field: str, shown: str | None = None) -> Iterator[tuple[str, str]]:
    """(where, text) of `field` in every row of a data file, in file order: a corpus file's
    documents. A row without the field, or with something else than text in it, is one line
    naming the file, the row and what it has; a parquet file's column is checked once, from
    its schema, and read alone."""
    path, shown = Path(path), shown or str(path)
    parquet = suffix_of(path) == ".parquet"
    if parquet:
        _check_text_column(path, shown, field)
    word = "column" if parquet else "field"
    for where, row in read_rows(path, shown, columns=[field] if parquet else None):
        if field not in row:
            has = ", ".join(sorted(row)) or "no fields"
            raise StageError(
                f"{where}: no field {field!r} (it has: {has}); set text_field to the one that holds the text"
            )
        text = row[field]
        if text is None:
            raise StageError(f"{where}: {word} {field!r} is null, not text")
        if not isinstance(text, str):
            raise StageError(f"{where}: {word} {field!r} holds {type(text).__name__}, not text")
        yield where, text


def _check_text_column(path: Path, shown: str, field: str) -> None:
    """A parquet file's `field` is a column of strings, from the file's footer alone."""
    import pyarrow
    import pyarrow.parquet as pq
    import pyarrow.types as types

    try:
        schema = pq.read_schema(path)
    except pyarrow.ArrowException as err:
        raise _unreadable(shown, err) from None
    if field not in schema.names:
        raise StageError(
            f"{shown}: no column {field!r} (it has: {', '.join(schema.names)}); "
            "set text_field to the one that holds the text"
        )
    kind = schema.field(field).type
    if not (types.is_string(kind) or types.is_large_string(kind)):
        raise StageError(f"{shown}: column {field!r} holds {kind}, not text (a string column)")
