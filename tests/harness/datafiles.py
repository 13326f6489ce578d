"""Data files as users hand them in: rows written as JSON lines (plain, gzip, zstandard) or
parquet, by the path's suffix, for the task-family and corpus tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def write_rows(
    path: Path, rows: list[dict[str, Any]], *, row_group_size: int | None = None
) -> Path:
    """`rows` as the data file `path`'s suffix names (.jsonl, .jsonl.gz, .jsonl.zst, .parquet);
    `row_group_size` cuts a parquet file into several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
        return path
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path
