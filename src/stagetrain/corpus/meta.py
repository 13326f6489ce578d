"""data/meta.json, the tokenizer stage's record, as types: what prepare_tokenizer writes and
pretrain, GRPO, consolidate, evaluate and publish read.

The types live here, apart from their writers (`prepare_tokenizer`, `corpus.sources`,
`tasks.families`), because readers of the file sit on both sides of them: `tasks.families`
writes a file family's record and reads the hub commits back from the whole file, so the
types must be importable without either module.
"""

from __future__ import annotations

from typing import Literal, TypedDict, final


@final
class LocalFileRecord(TypedDict):
    """A local file of a task family (one match of its glob)."""

    path: str


@final
class HubFileRecord(TypedDict):
    """A hub file of a task family: 'repo/file@revision' and the commit it resolved to, which
    later stages pin (`tasks.families.hub_pins`)."""

    hub: str
    commit: str


FileRecord = LocalFileRecord | HubFileRecord


class FamilyRecord(TypedDict):
    """A file family's provenance: its files and {level: {split: problems}} (levels as text,
    as JSON keys are)."""

    files: list[FileRecord]
    problems: dict[str, dict[str, int]]


class GeneratedRecord(TypedDict):
    """The generated source: its data.generated settings and the file families of the tasks
    section (GRPO reads their hub commits back as pins)."""

    kind: Literal["generated"]
    weight: float
    families: list[str]
    max_level: int
    prose_share: float
    level_weights: list[float] | None
    tasks: dict[str, FamilyRecord]


class FilesRecord(TypedDict):
    """A data.files entry, with the files its glob matched."""

    kind: Literal["files"]
    path: str
    weight: float
    text_field: str
    files: list[str]


class HubRecord(TypedDict):
    """A data.hub entry, with the commit its revision resolved to."""

    kind: Literal["hub"]
    repo: str
    files: list[str]
    revision: str
    weight: float
    text_field: str
    commit: str


SourceRecord = GeneratedRecord | FilesRecord | HubRecord


class SplitTotals(TypedDict):
    """One token shard."""

    tokens: int
    documents: int
    sha256: str


class SourceShare(TypedDict):
    """One source: its provenance and its tokens and documents per split."""

    name: str
    weight: float
    record: SourceRecord
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    train_repeats: int
    """Times its documents were started over to fill its share of the split (0: read once, or
    in part); val_repeats the same for the validation split."""
    val_repeats: int


class SpecialIds(TypedDict):
    """The tokenizer's special token ids, which the model config is given too; a pretrained
    tokenizer may have no bos token (the pipeline adds eos and pad, never bos)."""

    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int


class TokenizerMeta(SpecialIds):
    """data/meta.json: the shards' dtype and totals, the tokenizer and vocabulary, the sources."""

    dtype: str
    tokenizer_size: int
    model_vocab_size: int
    tokenizer_sha256: str
    train: SplitTotals
    val: SplitTotals
    sources: list[SourceShare]
