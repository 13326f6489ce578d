"""The skeleton both training loops share: resume, metrics log, cadences, checkpoints, outputs.

Pretraining and GRPO differ in what one step does (windows through the
engine; rollouts, advantages and a curriculum) and in what they record; what
is around the step is the same, and lives here once: loading the newest
complete checkpoint (or saying why the run starts fresh), the rank-0 metrics
log and its TensorBoard events, which steps log, evaluate and save, the
checkpoint and evaluation keys of summary.json, and writing the stage's
declared outputs on rank 0.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import numpy as np
import torch.distributed as dist

from stagetrain.config.settings import TrainingSettings
from stagetrain.io import atomic_write_bytes, atomic_write_json
from stagetrain.planning.plan import Layout, LayoutRecord
from stagetrain.training.checkpoints import Checkpoints, ClientState, tag_of
from stagetrain.training.metrics import MetricsLog, R, tensorboard_dir, window_log_on
from stagetrain.training.summary import LoopSummary, StageSummary

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from stagetrain.training.spec import JobSpec

log = logging.getLogger("stagetrain")
C = TypeVar("C", bound=ClientState)
"""A stage's client state (what its checkpoints carry)."""


S = TypeVar("S", bound=StageSummary)


class StageLoop(Generic[R, C]):
    """One training stage's run around its steps; every rank builds one (rank 0 writes). `R` is
    the type of the stage's metrics records, `C` that of its checkpoints' client state."""

    def __init__(
        self,
        *,
        stage: str,
        spec: JobSpec,
        cfg: TrainingSettings,
        engine: DeepSpeedEngine,
        checkpoints: Checkpoints,
    ) -> None:
        self.stage, self.spec, self.cfg = stage, spec, cfg
        self.engine, self.checkpoints = engine, checkpoints
        self.start = 0
        self.resumed_tag: str | None = None
        self.resumed_layout: dict[str, int] | None = None
        self.eval_windows: np.ndarray | None = None
        self.metrics: MetricsLog[R] | None = None

    def resume(self, registry: Mapping[str, str]) -> C | None:
        """Load the newest complete checkpoint into the engine, open the metrics log (rank 0).

        Returns the checkpoint's client state (None when the run starts at step 0);
        `start` is then its step. The log keeps only the records up to it.
        """
        client = None
        pointer = self.checkpoints.latest(final_step=self.cfg.steps)
        if pointer:
            # the state this stage's own `checkpoint` saved
            client = cast(C, self.checkpoints.load(self.engine, pointer))
            self.start, self.resumed_tag = client["step"], pointer["tag"]
            self.resumed_layout = pointer["layout"]
            log.info("resuming from %s at step %d", pointer["tag"], self.start)
        elif dist.get_rank() == 0 and (why := self.checkpoints.why_fresh()):
            log.info(why)
        if dist.get_rank() == 0:
            self.metrics = MetricsLog(
                self.checkpoints.folder / "metrics.jsonl",
                self.start,
                registry,
                tensorboard_dir(self.spec),
                self.spec.get("wandb"),
                self.spec.get("mlflow"),
            )
        return client

    def eval_set(self, windows: np.ndarray, client: C | None) -> np.ndarray:
        """The run's validation windows: `windows` (this layout's: their count follows the micro
        batch), or after a resume those the checkpoint recorded, unless `eval_batches` changed.

        Fixed at the run's start, so that eval losses before and after a resume under another
        layout compare, and consolidation verifies on the windows the last one was measured on.
        """
        if (
            client
            and client.get("eval_batches") == self.cfg.eval_batches
            and "eval_windows" in client
        ):
            windows = np.arange(client["eval_windows"])
        self.eval_windows = windows
        return windows

    def step_log(self, name: str, registry: Mapping[str, str]) -> MetricsLog | None:
        """Rank 0's `name` log beside metrics.jsonl (after `resume`: cut back to the resumed
        step as metrics.jsonl is); None on the other ranks."""
        if dist.get_rank() != 0:
            return None
        return MetricsLog(self.checkpoints.folder / name, self.start, registry)

    def debug_log(self, name: str, registry: Mapping[str, str]) -> MetricsLog | None:
        """`step_log` when the WINDOW_LOG debug option is on; None otherwise."""
        return self.step_log(name, registry) if window_log_on() else None

    def steps(self) -> range:
        """The steps still to train: after the resumed one, up to the configured count."""
        return range(self.start + 1, self.cfg.steps + 1)

    def logs(self, step: int) -> bool:
        return step % self.cfg.log_every == 0

    def evaluates(self, step: int) -> bool:
        """Every `eval_every` steps, and at the last."""
        return step % self.cfg.eval_every == 0 or step == self.cfg.steps

    def checkpoint(self, step: int, client_state: C) -> None:
        """Save every `checkpoint_every` steps and at the last (all ranks take part)."""
        if step % self.cfg.checkpoint_every == 0 or step == self.cfg.steps:
            state: ClientState = client_state
            if self.eval_windows is not None:
                state = {**state, "eval_windows": len(self.eval_windows),
                         "eval_batches": self.cfg.eval_batches}  # fmt: skip
            self.checkpoints.save(self.engine, step, state)

    def records(self) -> list[R]:
        """The stage's metrics across restarts (rank 0)."""
        text = (self.checkpoints.folder / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    def summary(self, *, final_eval_loss: float, layout: Layout) -> LoopSummary:
        """The summary keys every training stage writes: where its final checkpoint is, its
        layout and attention kernel, and the validation loss at the end with the windows it
        was measured on (what consolidation re-checks)."""
        final_step = self.cfg.steps
        saved, written = layout.to_json(), self.resumed_layout
        if self.start == final_step and written and written != layout.checkpoint_layout:
            # Resumed at the last step under another layout, nothing trained: the final
            # checkpoint is still in the layout it was written in, which consolidation reads.
            # (the pointer's layout holds dp, tp, zero_stage and ep where it is not 1)
            saved |= cast(LayoutRecord, {**written, "world": written["dp"] * written["tp"]})
        assert self.eval_windows is not None, "eval_set runs before the first step"
        return {
            "stage": self.stage,
            "final_step": final_step,
            "resumed_from_step": self.start,
            "layout": saved,
            "fingerprint": self.checkpoints.folder.name,
            "attention": self.engine.module.config._attn_implementation,  # the plan's, as run
            "checkpoint": {"folder": str(self.checkpoints.folder), "tag": tag_of(final_step)},
            "eval_batch": {
                "shard": self.spec["val"],
                "windows": self.eval_windows.tolist(),  # eval_set's
                "seq_len": layout.seq_len,
                "micro_batch_size": layout.micro_batch_size,
            },
            "final_eval_loss": final_eval_loss,
        }

    def write_outputs(self, summary: S, plot: Callable[[S, str], None], plot_path: str) -> None:
        """The stage's declared outputs (rank 0): metrics, the plot at `plot_path`, summary last."""
        atomic_write_bytes(
            self.spec["metrics"], (self.checkpoints.folder / "metrics.jsonl").read_bytes()
        )
        plot(summary, plot_path)
        atomic_write_json(self.spec["summary"], summary)
        if self.metrics is not None:
            self.metrics.close()


def quiet_other_ranks() -> None:
    """Only rank 0 logs progress; the others' warnings and errors still show."""
    if dist.get_rank() != 0:
        logging.getLogger("stagetrain").setLevel(logging.WARNING)
