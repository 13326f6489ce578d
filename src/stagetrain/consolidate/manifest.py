"""MANIFEST.json's type: what `consolidate.folder` writes beside the weights, and what GRPO reads
of its start model (its own module, so that reading it imports no consolidation code)."""

from typing import Literal, TypedDict

from stagetrain.planning.plan import LayoutRecord

MANIFEST = "MANIFEST.json"
"""The manifest's name in a consolidated folder (publish pushes what it lists)."""


class LossCheck(TypedDict):
    """`consolidate.verify: loss`: the reloaded folder's validation loss, the training's, and
    the relative tolerance between them."""

    method: Literal["loss"]
    eval_loss: float
    training_eval_loss: float
    relative_tolerance: float


class FiniteCheck(TypedDict):
    """`consolidate.verify: finite`: the tensors read back, every value finite; the training's
    validation loss for the record."""

    method: Literal["finite"]
    tensors: int
    training_eval_loss: float


class ManifestFile(TypedDict):
    """One file of the folder in the manifest."""

    sha256: str
    bytes: int


class Manifest(TypedDict):
    """MANIFEST.json (`consolidate`; docs/architecture.md, "Contracts between stages"): what was
    consolidated (the stage's summary: step, tag, fingerprint, layout), as what dtype and
    vocabulary, how it was verified, the library versions, every file's sha256 and size, and
    `weights_sha256` (of the weights alone), which GRPO's checkpoint fingerprint takes."""

    stage: str
    step: int
    tag: str
    fingerprint: str
    layout: LayoutRecord
    dtype: str
    tokenizer_size: int
    vocab_size: int
    verification: LossCheck | FiniteCheck
    versions: dict[str, str]
    files: dict[str, ManifestFile]
    weights_sha256: str
