"""Resumable checkpoints, kept outside the rule's declared outputs (Snakemake deletes those).

Layout: <root>/<fingerprint>/ holds DeepSpeed's tag folders (step00000050, ...),
`components.json` (what the fingerprint was made of) and `latest.json`, the
pointer to the newest complete checkpoint and the list of the complete ones
kept. Every rank saves its shard, all ranks meet at a barrier, and only then
rank 0 replaces the pointer atomically, so a run killed while saving resumes
from the previous complete checkpoint. Before resuming, the checkpoint's files
are checked (`integrity`); a damaged one falls back to an earlier complete one.

The fingerprint covers everything that changes the maths: model config,
tokenizer, training data, the stage's hyperparameters, precision and seed.
A changed config gets a new fingerprint, so it starts fresh, and the log says
which components changed. The layout (dp, tp, ZeRO stage) is not part of it: a
checkpoint written under another layout is resharded for this one
(`stagetrain.training.reshard`: loaded as it is, or converted once to
DeepSpeed's universal checkpoint beside the original), so a run that lost a
node continues on the ones left. The pointer records the layout of each tag.

Only one run writes here at a time: `hold` has rank 0 lock the stage's
checkpoint root (stagetrain.training.lock) before anything is written.

What a checkpoint carries beside DeepSpeed's state (its client state) is `ClientState`, which
each stage extends with its own keys. No `from __future__ import annotations` here: Python
3.11 reads `NotRequired` only from evaluated annotations.

Debug hook, for the test that kills a rank in the middle of a save: with
STAGETRAIN_KILL_DURING_SAVE=<rank>:<step> set, that rank writes the first file
of that step's save, cuts it to half its size and SIGKILLs itself, as a kill
during `torch.save` would leave it. Nothing else reads the variable.
"""

import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch.distributed as dist

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json
from stagetrain.training import reshard
from stagetrain.training.integrity import (
    POINTER,
    Pointer,
    ResumePoint,
    read_pointer,
    resume_point,
    step_of,
    weights_only_loads,
)
from stagetrain.training.lock import StageLock

if TYPE_CHECKING:  # DeepSpeed's import is paid by the ranks, which import it anyway
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("stagetrain")
RESUME_DECISION_TIMEOUT = timedelta(hours=6)
"""How long the other ranks wait for rank 0's resume decision: the integrity check and, under
another layout, the conversion, which runs at tens of MB/s (docs/benchmarks.md): a 7B model's
~100 GB checkpoint takes about half an hour, past the collective timeout of training/engine.py."""
KILL_DURING_SAVE = "STAGETRAIN_KILL_DURING_SAVE"


class ClientState(TypedDict):
    """A checkpoint's client state: the step it was saved after and, since checkpoints
    recorded them (`loop.StageLoop.checkpoint`), the count of validation windows and the
    `eval_batches` they were chosen under. Each stage adds its own keys
    (`pretrain.train.PretrainClient`, `grpo.run.GrpoClient`)."""

    step: int
    eval_windows: NotRequired[int]
    eval_batches: NotRequired[int]


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
        self.lock: StageLock | None = None

    def hold(self) -> None:
        """Rank 0 locks the stage's checkpoint root for the rest of its life; all ranks learn the outcome.

        Every rank must call it, before anything is written: the others wait
        for rank 0's answer, so none writes before rank 0 holds the lock, and
        when another run holds it every rank raises the same one-line error.
        """
        error = None
        if self.rank == 0:
            try:
                self.lock = StageLock(self.folder.parent)
                self.lock.acquire()
                _check_writable(self.folder)
            except StageError as err:
                error = str(err)
        if dist.is_initialized():
            answer = [error]
            dist.broadcast_object_list(answer, src=0)
            error = answer[0]
        if error:
            raise StageError(error)

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

    def latest(self, final_step: int | None = None) -> ResumePoint | None:
        """The pointer to the newest complete, intact checkpoint, made loadable under this run's layout.

        Rank 0 checks the files (`integrity.resume_point`: a damaged newest
        checkpoint falls back to an earlier complete one), converts a checkpoint
        of another layout (`reshard`; `load_tag` is then the folder to load) and
        tells every rank its decision, so all ranks load the same folder or all
        stop with the same line. A checkpoint at `final_step` (the stage is complete) under a
        layout change no format carries is loaded for its weights alone (`module_only`).
        """
        outcome: ResumePoint | str | None = None  # a str: the error every rank raises
        wide = dist.is_initialized() and dist.get_world_size() > 1
        # The others wait while rank 0 converts (minutes for a large checkpoint): longer than the
        # collective timeout allows, so the decision travels on a group of its own.
        group = dist.new_group(backend="gloo", timeout=RESUME_DECISION_TIMEOUT) if wide else None
        if self.rank == 0:
            try:
                outcome = self._loadable(resume_point(self.folder, self.layout), final_step)
            except StageError as err:
                outcome = str(err)
        if wide:
            box = [outcome]
            dist.broadcast_object_list(box, src=0, group=group)
            dist.destroy_process_group(group)
            outcome = box[0]
        if isinstance(outcome, str):
            raise StageError(outcome)
        return outcome

    def _loadable(self, point: Pointer | None, final_step: int | None) -> ResumePoint | None:
        """`point` with the tag folder this run's layout loads (`load_tag`), converted if it must be."""
        if point is None:
            return None
        how = reshard.plan(point["layout"], self.layout, final=point["step"] == final_step)
        if how == "weights":
            log.info("%s -> %s: the checkpoint at step %d is the stage's last, so only its weights are loaded",
                     reshard.describe(point["layout"]), reshard.describe(self.layout), point["step"])  # fmt: skip
            return {**point, "load_tag": point["tag"], "module_only": True}
        if how == "as_is":
            log.info("%s -> %s: the ZeRO-0 checkpoint at step %d holds the whole state; loading it as it is",
                     reshard.describe(point["layout"]), reshard.describe(self.layout), point["step"])  # fmt: skip
        if how != "universal":
            return {**point, "load_tag": point["tag"], "module_only": False}
        tag = reshard.convert(self.folder, point["tag"], point["layout"], self.layout)
        reshard.check_universal(self.folder / tag)
        return {**point, "load_tag": tag, "module_only": False}

    def load(self, engine: "DeepSpeedEngine", point: ResumePoint) -> ClientState:
        """Load `point` (from `latest`) into `engine` on every rank; the checkpoint's client state."""
        options = reshard.load_options(point)
        config = engine._config  # DeepSpeed reads load_universal from its config at load time
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = options.universal
        client: ClientState  # the client_state save() gave DeepSpeed
        try:
            with weights_only_loads():  # DeepSpeed's loader asks for weights_only=False
                _, client = engine.load_checkpoint(
                    str(self.folder), tag=options.tag, load_module_only=options.module_only
                )
        finally:
            config.load_universal_checkpoint = before
        if options.universal:
            reshard.mend_optimizer(engine.optimizer)
            restored = reshard.restore_buffers(engine.module, self.folder / options.tag)
            if restored:
                log.info("restored %d buffers from %s's model states (%s, ...)",
                         len(restored), options.tag, restored[0])  # fmt: skip
        return client

    def save(self, engine: "DeepSpeedEngine", step: int, client_state: ClientState) -> None:
        """Save on every rank, then (rank 0) point at it and drop checkpoints beyond `keep`."""
        tag = tag_of(step)
        if self.rank == 0:
            # What a save of this step killed halfway left (never pointed at): under another
            # layout its files, of other names, would sit beside this save's and break the
            # next conversion ("ZeRO file count 3 is not divisible by ... tp_degree=2").
            for old in (tag, *reshard.universal_tags(tag)):
                shutil.rmtree(self.folder / old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        if os.environ.get(KILL_DURING_SAVE) == f"{self.rank}:{step}":
            _die_in_first_file(engine)
        try:
            engine.save_checkpoint(
                str(self.folder), tag=tag, client_state=dict(client_state), save_latest=False
            )
        except OSError as err:
            raise self._failed(tag, err) from None
        except RuntimeError as err:
            # torch.save reports a full disk as its zip writer's error ("[enforce fail at
            # inline_container.cc:672] . unexpected pos 576 vs 534"); any other RuntimeError
            # (a peer rank gone mid-save) is not a write failure and keeps its own report.
            if "inline_container" not in str(err) and "PytorchStreamWriter" not in str(err):
                raise
            raise self._failed(tag, err) from None
        if dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            return
        try:
            atomic_write_json(self.folder / "components.json", self.components)
            self._point_at(tag, step)
        except OSError as err:
            raise self._failed(tag, err) from None

    def _point_at(self, tag: str, step: int) -> None:
        """Replace the pointer with one at `tag`, and drop the tags that fall out of `keep`."""
        pointer = self.folder / POINTER
        earlier = read_pointer(pointer) if pointer.exists() else None
        kept = earlier["complete"] if earlier else []
        # Only tags older than this one: after a fallback, a damaged newer tag is not complete.
        complete = [tag, *[t for t in kept if step_of(t) < step]][: self.keep]
        layouts = {**(earlier["layouts"] if earlier else {}), tag: self.layout}
        written: Pointer = {"tag": tag, "step": step, "layout": self.layout, "complete": complete,
                            "layouts": {t: layouts[t] for t in complete}}  # fmt: skip
        atomic_write_json(pointer, written)
        # Pruned: the tags the pointer listed that fell out of `keep`, with their universal copies
        # (or a killed conversion's temp folder). A tag no pointer listed is not this run's to drop.
        dropped = set(kept) - set(complete)
        for old in [*self.folder.glob("step*"), *self.folder.glob(".step*.tmp")]:
            if old.is_dir() and reshard.source_tag(old.name) in dropped:
                shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s saved in %s", tag, self.folder)

    def _failed(self, tag: str, err: BaseException) -> StageError:
        """The one line for a save that could not be written (a full disk, a read-only folder),
        after removing what it left: a partial tag is never pointed at, but it would take the
        space the next attempt needs, and it was 8 MB of the tiny model's 16."""
        shutil.rmtree(self.folder / tag, ignore_errors=True)
        why = (
            err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
        )
        where = self.folder if self.folder.exists() else self.folder.parent
        free = shutil.disk_usage(where).free if where.exists() else 0
        try:
            kept = read_pointer(self.folder / POINTER)["tag"]
        except (OSError, StageError):
            kept = None
        return StageError(
            f"checkpoint {tag}: could not be written in {self.folder} ({why}; {free / 2**20:.0f} MiB "
            f"free there); the partial save was removed, and "
            + (f"the run resumes from {kept}" if kept else "no earlier checkpoint exists")
            + ": free space or make the folder writable, then rerun"
        )


def _check_writable(folder: Path) -> None:
    """A one-line error now if the run cannot write its checkpoint folder: a read-only one
    was a traceback inside the ranks at the first write (the metrics log, after the engines)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise StageError(f"{folder}: cannot write the stage's checkpoints here ({err.strerror}); "
                         "make it writable, or free space, then rerun") from None  # fmt: skip


def _die_in_first_file(engine: Any) -> None:
    """The debug hook (module docstring): the next file `engine` saves is cut in half, then SIGKILL."""
    save = engine.checkpoint_engine.save

    def save_then_die(state_dict: Any, path: str) -> None:
        save(state_dict, path)
        os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    engine.checkpoint_engine.save = save_then_die
