"""Rows of a data file: JSON lines (plain, gzip or zstandard) or parquet, chosen by suffix.

The one reader of the task families' files (`read_rows`) and of the corpus's
(`read_texts`, one text field of each row). Each row comes with where it is
('tasks/sort.parquet:row 12', 'x.jsonl.gz:3') so that every later complaint about
it names the file and the row. Parquet is read with pyarrow and zstandard frames
with the zstandard package (both maintained readers; Python's own gzip covers
.gz). Files stream, a line or a record batch at a time; a corpus's parquet file is
read one column, in batches of `BATCH_ROWS`, so memory does not grow with it.

A compressed stream must prove it reached its end: gzip raises on a cut member by
itself, and `_ZstdFrames` does the same for zstandard, whose own stream reader
takes a cut frame for a clean end of file (it also stops after the first frame
unless told otherwise). No line is read past `MAX_LINE_BYTES`, so a small file that
decompresses to one huge line is refused before it is held in memory.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from stagetrain.errors import StageError
from stagetrain.io import json_lines

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")
"""What the readers take, by suffix. `.json` is JSON lines, as `datasets.Dataset.to_json` writes
by default, or one JSON array of rows (`lines=False`) up to MAX_LINE_BYTES, as the hub's json
loader reads both."""
BATCH_ROWS = 1024
"""Rows of a parquet file decoded at once: at 10 KB a corpus document, 10 MB."""
MAX_LINE_BYTES = 64 * 2**20
"""The longest JSON line read: a book-length document is a few MB; a line past this is
refused rather than held whole in memory (a 65 KB .zst can hold a 2 GiB line)."""
ZSTD_FEED_BYTES = 1024
"""Compressed bytes handed to the decompressor at once. zstandard inflates at most about
32,000 to 1, so one call's output stays under 32 MB whatever the file holds."""


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
    corrupt: tuple[type[Exception], ...] = (OSError, EOFError)  # a truncated stream, a bad file
    if kind == ".jsonl.zst":
        import zstandard

        corrupt += (zstandard.ZstdError,)
    try:
        with _opened(path, kind) as handle:
            if kind == ".json" and _starts_array(handle):
                yield from _json_array(handle, shown)
            else:
                yield from _json_lines(handle, shown)
    except corrupt as err:
        raise StageError(
            f"{shown}: cannot read ({getattr(err, 'strerror', None) or err})"
        ) from None


def _opened(path: Path, kind: str) -> IO[bytes]:
    if kind == ".jsonl.gz":
        # a binary file object; typeshed derives GzipFile from BufferedIOBase, not from IO[bytes]
        return cast(IO[bytes], gzip.open(path, "rb"))
    if kind == ".jsonl.zst":
        import zstandard

        return io.BufferedReader(_ZstdFrames(open(path, "rb"), zstandard.ZstdDecompressor()))  # noqa: SIM115 - closed with the reader
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstandard frame of `raw`, in order, and EOFError
    ('truncated zstd stream') when the file ends inside a frame. zstandard's stream reader
    cannot tell a cut frame from the end of the file, so each frame gets its own
    decompression object, whose `eof` says whether the frame was whole."""

    def __init__(self, raw: IO[bytes], decompressor: Any) -> None:
        self._raw, self._decompressor = raw, decompressor
        self._frame: Any = None  # the frame being decompressed; None before the first byte
        self._input, self._at = b"", 0  # compressed bytes read and not yet fed, and where
        self._output = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._output:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._output))
        buffer[:n] = self._output[:n]
        self._output = self._output[n:]
        return n

    def _decompress_more(self) -> bool:
        if self._at == len(self._input):
            self._input, self._at = self._raw.read(64 * ZSTD_FEED_BYTES), 0
            if not self._input:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("truncated zstd stream")
                return False
        if self._frame is None or self._frame.eof:
            self._frame = self._decompressor.decompressobj()
        piece = self._input[self._at : self._at + ZSTD_FEED_BYTES]
        self._at += len(piece)
        self._output = memoryview(self._frame.decompress(piece))
        if self._frame.eof and self._frame.unused_data:  # the next frame starts in this piece
            self._input = self._frame.unused_data + self._input[self._at :]
            self._at = 0
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()


def _bounded_lines(handle: IO[bytes], shown: str) -> Iterator[bytes]:
    """The lines of `handle`, none read past MAX_LINE_BYTES."""
    for number in itertools.count(1):
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise StageError(
                f"{shown}:{number}: a line of more than {MAX_LINE_BYTES} bytes; "
                "expected one JSON object a line"
            )
        yield line


def _json_lines(handle: IO[bytes], shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, row in json_lines(_bounded_lines(handle, shown), shown):
        if not isinstance(row, dict):
            raise StageError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _starts_array(handle: IO[bytes]) -> bool:
    """Whether a .json file is one array (its first non-blank byte '['); the handle is left at
    the start."""
    head = handle.read(4096).lstrip()
    handle.seek(0)
    return head.startswith(b"[")


def _json_array(handle: IO[bytes], shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a .json file holding one array of objects, bounded as a line is."""
    data = handle.read(MAX_LINE_BYTES + 1)
    if len(data) > MAX_LINE_BYTES:
        raise StageError(f"{shown}: a JSON array of more than {MAX_LINE_BYTES} bytes; "
                         "write JSON lines instead (Dataset.to_json's default)")  # fmt: skip
    try:
        rows = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StageError(f"{shown}: not valid JSON ({getattr(err, 'msg', err)})") from None
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise StageError(
                f"{shown}:item {number}: expected a JSON object, got {type(row).__name__}"
            )
        yield f"{shown}:item {number}", row


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
