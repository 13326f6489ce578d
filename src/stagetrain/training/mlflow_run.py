"""MLflow as a tracker: one run per stage and checkpoint folder, holding the stage's config as
params, every record of its metrics.jsonl as metrics at their steps, and its consolidated model
folder as an artifact.

MLflow chooses its own run ids, so a run is found by its tag `stagetrain.run`, the name W&B's
run gets as its id (`<run>-<stage>-<fingerprint>`): a resumed stage continues its run, and the
consolidate stage logs the folder into the run that trained it. A run made after its stage
began (MLflow turned on for a finished run, which resumes at its last checkpoint) is given the
records metrics.jsonl already holds, so every run holds the stage's whole history. A resumed
run keeps the points past its checkpoint that the killed run had sent: MLflow cannot delete a
metric's points, so those steps hold two values (metrics.jsonl, cut back, holds one).

`MlflowClient` with an explicit run id, not the fluent `mlflow.start_run`: the fluent API keeps
one active run per process, and the stage log and the consolidate stage each need their own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stagetrain.config.settings import MlflowSettings
from stagetrain.errors import StageError
from stagetrain.training.spec import MlflowRun

log = logging.getLogger("stagetrain")
TAG = "stagetrain.run"
MISSING = (
    "tracking.report_to: 'mlflow' needs the mlflow package, which is not installed: "
    "pip install 'stagetrain[mlflow]' (or leave mlflow out of report_to)"
)
PARAM_LENGTH = 6000
"""MLflow refuses a param value longer than this (mlflow.utils.validation's limit)."""
BATCH = 100
"""Params per log_batch call, MLflow's limit (metrics: 1000; 100 keeps every call small)."""
INVALID = re.compile(r"[^\w./\- :]")
"""Characters MLflow refuses in a metric or param name."""


def metric_name(key: str) -> str:
    """`key` as MLflow takes it: a unit in brackets joined with `_` and `%` as pct
    (`memory/max_rss(GiB)` -> `memory/max_rss_GiB`, `throughput/mfu(%)` ->
    `throughput/mfu_pct`), any other character MLflow refuses as `_`."""
    return INVALID.sub("_", key.replace("%", "pct").replace("(", "_").replace(")", ""))


def run_key(name: str, checkpoints: Path) -> str:
    """The tag that names a stage's run: its name (`<run>-<stage>`) and its checkpoint folder's
    (the fingerprint), W&B's run id too, so a run with another config is another run."""
    return f"{name}-{checkpoints.name}"


def tracking_uri(settings: MlflowSettings) -> str:
    """Where the runs go: `tracking.mlflow.tracking_uri`, else MLflow's own MLFLOW_TRACKING_URI.

    Raises:
        StageError: neither is set (MLflow would otherwise write ./mlruns wherever it runs).
    """
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise StageError(
            "tracking.mlflow.tracking_uri: not set, nor MLFLOW_TRACKING_URI, and tracking.report_to "
            "names mlflow: say where its runs go (e.g. http://127.0.0.1:5000 or sqlite:///mlflow.db)"
        )
    return uri


def _client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise StageError(MISSING) from None
    return MlflowClient(uri)


@contextmanager
def _answer_fast() -> Iterator[None]:
    """MLflow retries a refused request 7 times over about two minutes: at a stage's start a
    server that does not answer should be one line at once, not a silent wait."""
    saved = {
        k: os.environ.get(k)
        for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    }
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", MLFLOW_HTTP_REQUEST_TIMEOUT="20")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def experiment_id(client: Any, uri: str, experiment: str) -> str:
    """The id of `experiment` at `uri`, made if missing.

    Raises:
        StageError: the server cannot be reached or refuses (one line naming the key and URI).
    """
    try:
        with _answer_fast():
            found = client.get_experiment_by_name(experiment)
            return str(found.experiment_id if found else client.create_experiment(experiment))
    except Exception as err:  # MlflowException, requests' errors: all one line here
        raise StageError(
            f"tracking.mlflow.tracking_uri: {uri}: MLflow did not answer: {_one_line(err)}"
        ) from None


def _one_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check(settings: MlflowSettings) -> None:
    """Before any rank starts: the package is there, a URI is given and its server answers."""
    uri = tracking_uri(settings)
    experiment_id(_client(uri), uri, settings.experiment)


def params(part: Mapping[str, Any]) -> dict[str, str]:
    """A stage's config part as MLflow params: nested keys joined with dots, lists as JSON."""
    out: dict[str, str] = {}
    for key, value in part.items():
        if isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in params(value).items()})
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            out[metric_name(str(key))] = text[:PARAM_LENGTH]
    return out


class MlflowLog:
    """The MLflow run of one stage and checkpoint folder (`key`), open for its records."""

    def __init__(
        self, run: MlflowRun, key: str, history: Iterable[Mapping[str, float | int]]
    ) -> None:
        """Continue the run tagged `key`, or make it with the stage's params and `history` (the
        records metrics.jsonl kept: (step, scalars) maps, `step` among them)."""
        self.client = _client(run["tracking_uri"])
        experiment = experiment_id(self.client, run["tracking_uri"], run["experiment"])
        self.run_id = find_run(self.client, experiment, key)
        if self.run_id is None:
            made = self.client.create_run(experiment, run_name=run["name"], tags={TAG: key})
            self.run_id = made.info.run_id
            self._params(run["params"])
            for record in history:
                self.log(record)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("MLflow: continuing run %s (%s)", self.run_id, key)

    def _params(self, values: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(values.items())]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH])

    def log(self, record: Mapping[str, float | int]) -> None:
        """One record's scalars at its step."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(record["step"])
        items = [
            Metric(metric_name(k), float(v), now, step) for k, v in record.items() if k != "step"
        ]
        for i in range(0, len(items), 10 * BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + 10 * BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def find_run(client: Any, experiment: str, key: str) -> str | None:
    """The id of the run tagged `key` in `experiment`, None if there is none."""
    found = client.search_runs([experiment], f"tags.`{TAG}` = '{key}'", max_results=1)
    return found[0].info.run_id if found else None


def log_model(settings: MlflowSettings, name: str, key: str, folder: Path) -> None:
    """Add the consolidated model `folder` to the artifacts (under `model/`) of the run tagged
    `key`, made (named `name`) if the stage trained without MLflow.

    Raises:
        StageError: the server cannot be reached, or refuses the upload.
    """
    uri = tracking_uri(settings)
    client = _client(uri)
    experiment = experiment_id(client, uri, settings.experiment)
    run_id = find_run(client, experiment, key)
    if run_id is None:
        run_id = client.create_run(experiment, run_name=name, tags={TAG: key}).info.run_id
    try:
        client.log_artifacts(run_id, str(folder), "model")
    except Exception as err:
        raise StageError(
            f"tracking.mlflow.tracking_uri: {uri}: the model upload failed: {_one_line(err)}"
        ) from None
    log.info("MLflow: %s logged as model/ of run %s (%s)", folder, run_id, key)
