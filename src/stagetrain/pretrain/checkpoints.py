"""Resumable checkpoints, kept outside the rule's declared outputs (Snakemake deletes those).

Layout: <root>/<fingerprint>/ holds DeepSpeed's tag folders (step00000050, ...),
`components.json` (what the fingerprint was made of) and `latest.json`, the
pointer to the newest complete checkpoint. Every rank saves its shard, all
ranks meet at a barrier, and only then rank 0 replaces the pointer atomically,
so a run killed while saving resumes from the previous complete checkpoint.

The fingerprint covers everything that changes the maths: model config,
tokenizer, training data, the stage's hyperparameters, precision and seed.
A changed config gets a new fingerprint, so it starts fresh, and the log says
which components changed. The layout (dp, tp, ZeRO stage) is not part of it: a
checkpoint resumed under another layout is refused with a message, because
DeepSpeed's sharded files are tied to the layout that wrote them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json

log = logging.getLogger("stagetrain")
POINTER = "latest.json"


def fingerprint(components: Mapping[str, Any]) -> str:
    """16 hex digits of the sha256 of the components' canonical JSON."""
    blob = json.dumps(components, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tag_of(step: int) -> str:
    """DeepSpeed tag (sub-folder) of the checkpoint after `step` optimizer steps."""
    return f"step{step:08d}"


class Checkpoints:
    """The checkpoint folder of one stage run (all ranks construct it; rank 0 writes pointers)."""

    def __init__(
        self, root: Path, components: Mapping[str, Any], layout: Mapping[str, int], keep: int
    ) -> None:
        self.components = dict(components)
        self.folder = root / fingerprint(components)
        self.layout = dict(layout)
        self.keep = keep
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def why_fresh(self) -> str | None:
        """If other fingerprints exist beside ours, which components differ from the newest."""
        others = sorted(
            (p for p in self.folder.parent.glob("*/components.json") if p.parent != self.folder),
            key=lambda p: p.stat().st_mtime,
        )
        if not others:
            return None
        previous = read_json(others[-1])
        changed = sorted(
            k
            for k in set(previous) | set(self.components)
            if previous.get(k) != self.components.get(k)
        )
        return f"config changed since checkpoint {others[-1].parent.name} ({', '.join(changed)}): starting fresh"

    def latest(self) -> dict[str, Any] | None:
        """The pointer to the newest complete checkpoint, checked against this run's layout."""
        path = self.folder / POINTER
        if not path.exists():
            return None
        pointer = read_json(path)
        if pointer["layout"] != self.layout:
            raise StageError(
                f"{self.folder}: the checkpoint at step {pointer['step']} was written with layout "
                f"{pointer['layout']}, this run is {self.layout}; DeepSpeed checkpoints are tied to their "
                "layout: delete the folder to start fresh, or convert it with DeepSpeed's ds_to_universal"
            )
        return pointer

    def save(self, engine: Any, step: int, client_state: Mapping[str, Any]) -> None:
        """Save on every rank, then (rank 0) point at it and drop checkpoints beyond `keep`."""
        tag = tag_of(step)
        engine.save_checkpoint(
            str(self.folder), tag=tag, client_state=dict(client_state), save_latest=False
        )
        if dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            return
        atomic_write_json(self.folder / "components.json", self.components)
        atomic_write_json(self.folder / POINTER, {"tag": tag, "step": step, "layout": self.layout})
        tags = sorted(p for p in self.folder.glob("step*") if p.is_dir())
        for old in tags[: max(0, len(tags) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s saved in %s", tag, self.folder)
