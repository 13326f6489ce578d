"""parallelism_data.json tables in Psyche's format, from a local file or a hub repo.

Format: {"<GPU key>": {"<world size>": {"dp": int, "tp": int, "micro_batch_size": int}}}.
The GPU count is the total number of GPUs of the run (dp * tp).

Hub downloads go through `stagetrain.hub.fetch`. Every failure becomes a
`TableMiss` with a one-line reason, so the caller can fall back to the planner
(recording why) or fail.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagetrain.hub import HubError, fetch
from stagetrain.planning.plan import TableEntry

TABLE_FILE = "parallelism_data.json"
ENTRY_KEYS = tuple(TableEntry.__annotations__)
"""The keys every entry must have (it may have more): `TableEntry`'s."""

Table = dict[str, dict[str, TableEntry]]
"""A checked table: GPU key -> GPU count (a string of digits) -> entry."""


class TableMiss(Exception):
    """The table could not be used; the message says why in one line."""


def read_local(path: str | Path) -> tuple[Table, str]:
    """The table at `path` and its source label."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TableMiss(f"parallelism.table_path: {path}: file not found") from None
    except OSError as err:  # a directory, no permission, ...
        raise TableMiss(
            f"parallelism.table_path: {path}: cannot be read ({err.strerror or type(err).__name__})"
        ) from None
    except UnicodeDecodeError:
        raise TableMiss(f"{path}: malformed JSON (not UTF-8 text)") from None
    return parse(text, str(path)), f"file:{path}"


def download(repo: str, revision: str) -> tuple[Table, str]:
    """The table of hub repo `repo` at `revision`, and 'hub:<repo>@<commit>'."""
    where = f"hub repo {repo!r}@{revision}"
    try:
        path, commit = fetch(repo, TABLE_FILE, revision=revision)
    except HubError as err:
        raise TableMiss(str(err)) from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TableMiss(f"{where}: malformed JSON (not UTF-8 text)") from None
    return parse(text, where), f"hub:{repo}@{commit}"


def parse(text: str, where: str) -> Table:
    """Parse and check a table's structure, naming the first malformed entry."""
    try:
        table = json.loads(text)
    except json.JSONDecodeError as err:
        raise TableMiss(f"{where}: malformed JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(table, dict):
        raise TableMiss(f"{where}: malformed table (expected an object of GPU keys)")
    for gpu, counts in table.items():
        if not isinstance(counts, dict):
            raise TableMiss(
                f"{where}: malformed table at {gpu!r} (expected an object of GPU counts)"
            )
        for count, entry in counts.items():
            ok = isinstance(entry, dict) and set(entry) >= set(ENTRY_KEYS)
            # type() is int: JSON true/false are Python bools, which isinstance counts as ints.
            ok = ok and all(type(entry[k]) is int and entry[k] >= 1 for k in ENTRY_KEYS)
            # ASCII digits only: str.isdigit() also accepts e.g. '²', which int() rejects.
            if not ok or not (count.isascii() and count.isdigit()):
                raise TableMiss(
                    f"{where}: malformed table at {gpu!r}.{count!r} (expected a GPU count "
                    f"mapping to positive integers {', '.join(ENTRY_KEYS)})"
                )
    return table


def lookup(table: Table, gpu_key: str, world: int, where: str) -> TableEntry:
    """The entry for `gpu_key` and `world` GPUs, or a miss that lists what the table has."""
    entry = table.get(gpu_key, {}).get(str(world))
    if entry is None:
        have = (
            "; ".join(f"{g}: {', '.join(sorted(c, key=int))}" for g, c in table.items())
            or "nothing"
        )
        raise TableMiss(f"{where}: no entry for {gpu_key} x {world} (the table has {have})")
    return {"dp": entry["dp"], "tp": entry["tp"], "micro_batch_size": entry["micro_batch_size"]}
