"""Data files as users hand them in: rows written as JSON lines (plain, gzip, zstandard) or
parquet, by the path's suffix, for the task-family and corpus tests; and a user's own lm-eval
task with its local data, for the evaluate target."""

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


def lm_eval_task(folder: Path) -> Path:
    """A user's own multiple-choice lm-eval task, its data a local file: its YAML's path."""
    folder.mkdir(parents=True)
    rows = [
        {"question": f"Is {a} more than {b}?", "label": 0 if a > b else 1}
        for a, b in [(3, 2), (1, 5), (7, 4), (2, 9)]
    ]
    (folder / "yes_no.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "yes_no.yaml").write_text(
        "task: my_yes_no\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(folder / 'yes_no.jsonl'))}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: ['yes', 'no']\ndoc_to_target: label\nmetric_list: [{metric: acc}]\n"
    )  # fmt: skip
    return folder / "yes_no.yaml"
