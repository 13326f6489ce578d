"""Where training documents come from: the generated corpus, local files, hub datasets.

Each source yields documents for the train or the val split. Generated problems
take their split from the task library (by problem identity, so validation and
held-out problems never appear in training); other documents are assigned by a
hash of their text, so the assignment is stable across runs and machines.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stagetrain.corpus.prose import paragraph
from stagetrain.errors import StageError
from stagetrain.hub import HubError, fetch
from stagetrain.io import json_lines, not_utf8
from stagetrain.tasks import sample, training_text
from stagetrain.tasks.families import TaskSet, load_tasks

Split = Literal["train", "val"]
log = logging.getLogger("stagetrain")


@dataclass(frozen=True, kw_only=True)
class Source:
    """One source of documents and its share of the corpus."""

    name: str
    weight: float
    documents: Callable[[Split], Iterator[str]]
    record: dict[str, Any] = field(default_factory=dict)
    """Provenance for data/meta.json (kind, path or repo@commit, settings)."""
    controls: bool = False
    """Whether the documents hold the pipeline's control tokens (<|problem|>, <|answer|>) as
    markup: only the generated corpus does; any other text encodes such strings as text."""


def text_split(text: str, val_share: float) -> Split:
    """The split of a non-generated document, from a hash of its text."""
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "val" if digest % 1_000_000 < val_share * 1_000_000 else "train"


def generated(cfg: Mapping[str, Any], seed: int, tasks: TaskSet) -> Source:
    """Task problems with worked answers, mixed with templated prose: each document a family
    of `cfg["families"]` (built-in, or of the tasks section) drawn uniformly, then a level up
    to max_level, then a problem of the split."""
    unknown = [f for f in cfg["families"] if f not in tasks.families]
    if unknown:  # the config check names them first; a stage run on a section alone lands here
        raise StageError(
            f"data.generated.families: unknown family {unknown[0]!r} (known: {', '.join(tasks.families)})"
        )
    families = {name: tasks.families[name].family for name in cfg["families"]}
    record = {"kind": "generated", **cfg, "tasks": tasks.record()}

    def documents(split: Split) -> Iterator[str]:
        rng = random.Random(f"{seed}:generated:{split}")
        names = list(families)
        while True:
            if rng.random() < cfg["prose_share"]:
                yield paragraph(rng)
                continue
            family = families[rng.choice(names)]
            level = rng.randint(1, min(cfg["max_level"], family.max_level))
            yield training_text(sample(family.name, level, split, rng))

    return Source(name="generated", weight=cfg["weight"], documents=documents, record=record,
                  controls=True)  # fmt: skip


def _read_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of one file: a whole .txt file, or one per line of a .jsonl file."""
    if path.suffix == ".txt":
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise not_utf8(str(path), data, err) from None
        yield text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as text mode reads them
        return
    if path.suffix != ".jsonl":
        raise StageError(f"{path}: expected a .txt or .jsonl file")
    with open(path, "rb") as handle:
        for where, row in json_lines(handle, str(path)):
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise StageError(f"{where}: expected an object with a string field {text_field!r}")
            yield row[text_field]


def _file_source(
    name: str, paths: list[Path], cfg: Mapping[str, Any], val_share: float, record: dict
) -> Source:
    def documents(split: Split) -> Iterator[str]:
        for path in paths:
            for text in _read_documents(path, cfg["text_field"]):
                if text and text_split(text, val_share) == split:
                    yield text

    return Source(name=name, weight=cfg["weight"], documents=documents, record=record)


def files(cfg: Mapping[str, Any], index: int, val_share: float) -> Source:
    """Local .txt or .jsonl files matching a glob, in sorted order."""
    paths = sorted(Path(p) for p in glob.glob(cfg["path"], recursive=True))
    if not paths:
        raise StageError(f"data.files.{index}.path: {cfg['path']!r} matches no file")
    record = {"kind": "files", **cfg, "files": [str(p) for p in paths]}
    return _file_source(f"files:{cfg['path']}", paths, cfg, val_share, record)


def hub(cfg: Mapping[str, Any], index: int, val_share: float) -> Source:
    """Files of a hub dataset repo, downloaded (or taken from the cache) now."""
    paths, commits = [], set()
    for name in cfg["files"]:
        try:
            path, commit = fetch(cfg["repo"], name, revision=cfg["revision"], repo_type="dataset")
        except HubError as err:
            raise StageError(f"data.hub.{index}: {err}") from None
        paths.append(path)
        commits.add(commit)
    record = {"kind": "hub", **cfg, "commit": sorted(commits)[0]}
    return _file_source(f"hub:{cfg['repo']}", paths, cfg, val_share, record)


def build(data: Mapping[str, Any], seed: int, tasks: TaskSet | None = None) -> list[Source]:
    """Every source the `data` section names, with a positive weight; `tasks` holds the
    families the generated source may name (default: the built-in ones)."""
    tasks = tasks or load_tasks({})
    val_share = data["val_tokens"] / (data["train_tokens"] + data["val_tokens"])
    sources = []
    if data["generated"]["weight"] > 0:
        sources.append(generated(data["generated"], seed, tasks))
    sources.extend(files(cfg, i, val_share) for i, cfg in enumerate(data["files"]))
    sources.extend(hub(cfg, i, val_share) for i, cfg in enumerate(data["hub"]))
    if not sources:
        raise StageError("data: no source (data.generated.weight is 0 and no files or hub entries)")
    return sources
