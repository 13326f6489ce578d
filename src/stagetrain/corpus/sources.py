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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stagetrain.config.settings import DataSettings, FileData, GeneratedData, HubData
from stagetrain.corpus.meta import FilesRecord, GeneratedRecord, HubRecord, SourceRecord
from stagetrain.corpus.prose import paragraph
from stagetrain.errors import StageError
from stagetrain.hub import HubError, fetch
from stagetrain.io import not_utf8
from stagetrain.tasks import sample, training_text
from stagetrain.tasks.families import TaskSet, load_tasks
from stagetrain.tasks.files import SUFFIXES, read_texts, suffix_of

Split = Literal["train", "val"]
log = logging.getLogger("stagetrain")


@dataclass(frozen=True, kw_only=True)
class Source:
    """One source of documents and its share of the corpus."""

    name: str
    weight: float
    documents: Callable[[Split], Iterator[str]]
    record: SourceRecord
    """Provenance for data/meta.json (kind, path or repo@commit, settings)."""
    controls: bool = False
    """Whether the documents hold the pipeline's control tokens (<|problem|>, <|answer|>) as
    markup: only the generated corpus does; any other text encodes such strings as text."""


def text_split(text: str, val_share: float) -> Split:
    """The split of a non-generated document, from a hash of its text."""
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "val" if digest % 1_000_000 < val_share * 1_000_000 else "train"


def generated(cfg: GeneratedData, seed: int, tasks: TaskSet) -> Source:
    """Task problems with worked answers, mixed with templated prose: each document a family
    of `cfg.families` (built-in, or of the tasks section) drawn uniformly, then a level up
    to max_level (by `level_weights`, or uniformly), then a problem of the split."""
    unknown = [f for f in cfg.families if f not in tasks.families]
    if unknown:  # the config check names them first; a stage run on a section alone lands here
        raise StageError(
            f"data.generated.families: unknown family {unknown[0]!r} (known: {', '.join(tasks.families)})"
        )
    families = {name: tasks.families[name].family for name in cfg.families}
    levels = {name: _level_weights(cfg, name, fam.max_level) for name, fam in families.items()}
    record = GeneratedRecord(kind="generated", weight=cfg.weight, families=list(cfg.families),
                             max_level=cfg.max_level, prose_share=cfg.prose_share,
                             level_weights=None if cfg.level_weights is None else list(cfg.level_weights),
                             tasks=tasks.record())  # fmt: skip

    def documents(split: Split) -> Iterator[str]:
        rng = random.Random(f"{seed}:generated:{split}")
        names = list(families)
        while True:
            if rng.random() < cfg.prose_share:
                yield paragraph(rng)
                continue
            family = families[rng.choice(names)]
            top, weights = levels[family.name]
            if weights is None:  # randint, as before the key: an unweighted corpus is unchanged
                level = rng.randint(1, top)
            else:
                level = rng.choices(range(1, top + 1), weights)[0]
            yield training_text(sample(family.name, level, split, rng))

    return Source(name="generated", weight=cfg.weight, documents=documents, record=record,
                  controls=True)  # fmt: skip


def _level_weights(
    cfg: GeneratedData, family: str, family_top: int
) -> tuple[int, tuple[float, ...] | None]:
    """A family's highest corpus level and the weights of levels 1..that (None: equal)."""
    top = min(cfg.max_level, family_top)
    if cfg.level_weights is None:
        return top, None
    weights = cfg.level_weights[:top]
    if not any(w > 0 for w in weights):
        raise StageError(f"data.generated.level_weights: family {family!r} has levels 1..{top} here, "
                         f"and their weights {list(weights)} are all 0")  # fmt: skip
    return top, weights


def _read_documents(path: Path, text_field: str, shown: str) -> Iterator[str]:
    """Documents of one file: a whole .txt file, or one per row of a JSON lines (plain, .gz,
    .zst) or parquet file, read by the task files' reader. `shown`: the name errors use."""
    if path.suffix == ".txt":
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise not_utf8(shown, data, err) from None
        yield text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as text mode reads them
        return
    if suffix_of(path) is None:
        raise StageError(f"{shown}: expected a .txt file or one of {', '.join(SUFFIXES)}")
    for _, text in read_texts(path, text_field, shown):
        yield text


def _file_source(
    name: str, paths: list[tuple[Path, str]], cfg: FileData | HubData, val_share: float,
    record: FilesRecord | HubRecord,
) -> Source:  # fmt: skip
    """`paths`: each file with the name its errors give."""

    def documents(split: Split) -> Iterator[str]:
        for path, shown in paths:
            for text in _read_documents(path, cfg.text_field, shown):
                if text and text_split(text, val_share) == split:
                    yield text

    return Source(name=name, weight=cfg.weight, documents=documents, record=record)


def files(cfg: FileData, index: int, val_share: float) -> Source:
    """Local files matching a glob, in sorted order: .txt, JSON lines or parquet."""
    paths = sorted(Path(p) for p in glob.glob(cfg.path, recursive=True))
    if not paths:
        raise StageError(f"data.files.{index}.path: {cfg.path!r} matches no file")
    record = FilesRecord(kind="files", path=cfg.path, weight=cfg.weight,
                         text_field=cfg.text_field, files=[str(p) for p in paths])  # fmt: skip
    return _file_source(f"files:{cfg.path}", [(p, str(p)) for p in paths], cfg, val_share, record)


def hub(cfg: HubData, index: int, val_share: float) -> Source:
    """Files of a hub dataset repo, downloaded (or taken from the cache) now."""
    paths, commits = [], set()
    for name in cfg.files:
        try:
            path, commit = fetch(cfg.repo, name, revision=cfg.revision, repo_type="dataset")
        except HubError as err:
            raise StageError(f"data.hub.{index}: {err}") from None
        paths.append((path, f"{cfg.repo}/{name}"))
        commits.add(commit)
    record = HubRecord(kind="hub", repo=cfg.repo, files=list(cfg.files), revision=cfg.revision,
                       weight=cfg.weight, text_field=cfg.text_field, commit=sorted(commits)[0])  # fmt: skip
    return _file_source(f"hub:{cfg.repo}", paths, cfg, val_share, record)


def build(data: DataSettings, seed: int, tasks: TaskSet | None = None) -> list[Source]:
    """Every source the `data` section names, with a positive weight; `tasks` holds the
    families the generated source may name (default: the built-in ones)."""
    tasks = tasks or load_tasks()
    val_share = data.val_tokens / (data.train_tokens + data.val_tokens)
    sources = []
    if data.generated.weight > 0:
        sources.append(generated(data.generated, seed, tasks))
    sources.extend(files(cfg, i, val_share) for i, cfg in enumerate(data.files))
    sources.extend(hub(cfg, i, val_share) for i, cfg in enumerate(data.hub))
    if not sources:
        raise StageError("data: no source (data.generated.weight is 0 and no files or hub entries)")
    return sources
