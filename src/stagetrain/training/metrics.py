"""Training metrics shared by the stages: the JSON-lines log, TensorBoard events, the console progress line.

Each stage keeps its own registry of metric names (a `metrics` module in its
package): every key a stage writes to metrics.jsonl is listed
there with what it means and when it is logged, and `MetricsLog` refuses any
other; a test checks that nothing else is emitted. The same
records also go to TensorBoard event files (numbers as scalars, {name: number}
maps as one scalar per name), so `tensorboard --logdir results/<run>/tensorboard`
shows the curves of every stage while it trains, and, with `tracking.report_to`
naming wandb, to a Weights & Biases run (an optional package, `stagetrain[wandb]`), and naming
mlflow, to an MLflow run (`stagetrain[mlflow]`, training.mlflow_run).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, TypedDict, TypeVar

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_text
from stagetrain.training.mlflow_run import MlflowLog, run_key
from stagetrain.training.spec import JobSpec, MlflowRun, WandbRun

log = logging.getLogger("stagetrain")
WINDOW_LOG = "STAGETRAIN_WINDOW_LOG"
"""Debug option: set to 1, rank 0 of pretrain writes windows.jsonl (the training windows each
data-parallel rank read) and rank 0 of GRPO prompts.jsonl (the keys of the problems the step
drew), one record per step, beside metrics.jsonl in the checkpoint folder and cut back to the
resumed step on a restart as metrics.jsonl is: the proof that a resume under another layout
reads every window (prompt) once and in the uninterrupted run's order."""


def window_log_on() -> bool:
    """Whether the WINDOW_LOG debug option is set (the same on every rank: one environment)."""
    return os.environ.get(WINDOW_LOG) == "1"


def max_rss_gib() -> float:
    """Peak resident memory of this process, GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepRecord(TypedDict):
    """What every record of a stage's log holds: the step it is of. Each stage's record type
    names the rest (`pretrain.metrics.PretrainRecord`, `grpo.metrics.GrpoRecord`, and the debug
    logs' `pretrain.train.WindowRecord`, `grpo.train.PromptRecord`)."""

    step: int


R = TypeVar("R", bound=StepRecord)
"""The record type of one log."""


def scalars(record: StepRecord) -> dict[str, float]:
    """The plottable numbers of a record: numbers as they are; {name: number} maps and maps of
    them, lists of numbers and lists of such lists (an MoE layer's expert shares) flattened to
    `key/name`, `key/name/stat`, `key/i` and `key/i/j`; strings, nulls and lists of anything
    else left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key != "step":
            out.update(_numbers(key, value))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numbers(key: str, value: Any) -> dict[str, float]:
    if _is_number(value):
        return {key: float(value)}
    if isinstance(value, dict):  # {name: number} maps, and maps of them (rewards/<name>/mean)
        return {n: v for k, item in value.items() for n, v in _numbers(f"{key}/{k}", item).items()}
    if isinstance(value, list) and all(_is_number(v) or isinstance(v, list) for v in value):
        return {
            k: v for i, item in enumerate(value) for k, v in _numbers(f"{key}/{i}", item).items()
        }
    return {}


WANDB_MISSING = (
    "tracking.report_to: 'wandb' needs the wandb package, which is not installed: "
    "pip install 'stagetrain[wandb]' (or leave wandb out of report_to)"
)


def wandb_run(wandb: WandbRun, run_id: str) -> Any:
    """A Weights & Biases run for a stage (`wandb`: project, name, dir from the job spec).

    The id is fixed per checkpoint folder, so a resumed stage continues its run.
    W&B's own settings apply (WANDB_MODE=offline writes it under `dir` only).

    Raises:
        StageError: wandb is not installed (one line with the pip command).
    """
    try:
        import wandb as wandb_sdk
    except ImportError:
        raise StageError(WANDB_MISSING) from None
    Path(wandb["dir"]).mkdir(parents=True, exist_ok=True)
    return wandb_sdk.init(project=wandb["project"], name=wandb["name"], dir=wandb["dir"],
                          id=run_id, resume="allow")  # fmt: skip


def tensorboard_dir(spec: JobSpec) -> Path | None:
    """Where a stage's job spec asks for TensorBoard events (the stage launcher always does;
    the test harness's specs may leave them out)."""
    return Path(spec["tensorboard"]) if "tensorboard" in spec else None


def _whole_lines(path: Path) -> list[str]:
    """The records of a metrics file, less a torn last line (an append cut by a kill or a full
    disk), which is logged and dropped: it is past the checkpoint the run resumes from."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            log.warning("%s: its last line is torn (%d characters); dropped", path, len(lines[-1]))
            lines.pop()
    return lines


class MetricsLog(Generic[R]):
    """Appends records (of type `R`) to a JSON-lines file whose keys must all be in `registry`,
    and to TensorBoard event files in `events` and a Weights & Biases run (`wandb`) when given."""

    def __init__(
        self,
        path: Path,
        resume_step: int,
        registry: Mapping[str, str],
        events: Path | None = None,
        wandb: WandbRun | None = None,
        mlflow: MlflowRun | None = None,
    ) -> None:
        self.path, self.registry, self.events = path, registry, None
        # One W&B run per checkpoint folder (<run>-<stage>-<fingerprint>): a resume continues it.
        self.wandb = wandb_run(wandb, f"{wandb['name']}-{path.parent.name}") if wandb else None
        self.mlflow: MlflowLog | None = None
        if events is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                # tensorboard is a declared dependency, but a machine that lacks it (the offline
                # GPU check's, tools/gpu) still trains: the curves stay in metrics.jsonl.
                log.warning("no TensorBoard event files in %s: %s", events, err)
            else:
                # purge_step: after a resume, TensorBoard drops the events past the checkpoint
                # that the first run wrote, as the JSON log drops its lines.
                self.events = SummaryWriter(str(events), purge_step=resume_step + 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():  # after a restart, keep what the resumed checkpoint had reached
            kept = [line for line in _whole_lines(path) if json.loads(line)["step"] <= resume_step]
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
        if mlflow is not None:  # the same run key as W&B's; a new run gets the kept history
            history = ({"step": r["step"], **scalars(r)} for r in map(json.loads, kept))
            self.mlflow = MlflowLog(mlflow, run_key(mlflow["name"], path.parent), history)

    def write(self, record: R) -> None:
        """Append one record (unknown keys are a bug: raise)."""
        unknown = set(record) - set(self.registry)
        if unknown:
            raise KeyError(f"metrics not in the registry: {sorted(unknown)}")
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self.events is not None:
            for key, value in scalars(record).items():
                self.events.add_scalar(key, value, global_step=record["step"])
            self.events.flush()
        if self.wandb is not None:
            self.wandb.log(scalars(record), step=record["step"])
        if self.mlflow is not None:
            self.mlflow.log({"step": record["step"], **scalars(record)})

    def close(self) -> None:
        """Finish the W&B and MLflow runs (event files are flushed at every write)."""
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.close()


class Progress:
    """Console line: step, loss, tokens/s, ETA."""

    def __init__(self, total_steps: int, first_step: int) -> None:
        self.total, self.first, self.start = total_steps, first_step, time.monotonic()

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        elapsed = time.monotonic() - self.start
        done = step - self.first
        eta = elapsed / done * (self.total - step) if done else float("nan")
        return (
            f"step {step}/{self.total} loss {loss:.4f} tokens/s {tokens_per_s:,.0f} "
            f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta)) if eta == eta else '?'}"
        )


def check_finite(value: float, *, what: str, stage: str, step: int, precision: str) -> None:
    """Stop with one line when a loss every rank shares (all-reduced, or computed alike) is NaN or inf.

    Going on would save checkpoints of diverged weights. Under fp16 a
    non-finite value is left to DeepSpeed's loss scaler: it skips a step whose
    gradients overflow, lowers the scale, and stops the run itself when the
    scale cannot go lower.
    """
    if precision != "fp16" and not math.isfinite(value):
        raise StageError(
            f"{stage}: the {what} is {value} at step {step} ({precision}): the run diverged; "
            f"lower {stage}.optimizer.lr or check the data (no checkpoint of this step was saved)"
        )
