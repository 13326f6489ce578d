"""Trackers beside metrics.jsonl: TensorBoard by default, Weights & Biases and MLflow only when
asked and installed (MLflow against a real `mlflow server` on loopback)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.configs import edit_config
from harness.mlflow_server import free_port, mlflow_server
from harness.workflow import default_config, snakemake

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import TrackingSettings
from stagetrain.errors import StageError
from stagetrain.grpo.metrics import METRICS
from stagetrain.training.launch import grpo_part, job_spec, trackers
from stagetrain.training.metrics import MetricsLog, scalars
from stagetrain.training.mlflow_run import metric_name


def tracking(*report_to: str, **mlflow: Any) -> TrackingSettings:
    """A tracking section as the stages get it: validated, its defaults filled."""
    section = {"report_to": list(report_to), "wandb_project": "p", "mlflow": mlflow}
    return TrackingSettings.from_config(stconfig.validate_section("tracking", section), "tracking")


def test_tensorboard_is_on_and_wandb_off_by_default(tmp_path: Path) -> None:
    config = default_config()
    tracking = TrackingSettings.from_config(config["tracking"], "tracking")
    assert tracking.report_to == ("tensorboard",)
    found = trackers(tracking, tmp_path / "results/tiny", "pretrain")
    assert found == {
        "tensorboard": tmp_path / "results/tiny/tensorboard/pretrain", "wandb": None, "mlflow": None
    }  # fmt: skip
    spec = job_spec(inputs={}, outputs={}, checkpoints=tmp_path, part=grpo_part(config), **found)
    assert "wandb" not in spec and "mlflow" not in spec
    assert spec["tensorboard"].endswith("tensorboard/pretrain")


def test_an_empty_report_to_writes_no_events(tmp_path: Path) -> None:
    found = trackers(tracking(), tmp_path, "grpo")
    assert found == {"tensorboard": None, "wandb": None, "mlflow": None}


def test_wandb_without_the_package_is_one_line_naming_the_key_and_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import raises
    pattern = (
        r"^tracking\.report_to: 'wandb' needs the wandb package.*pip install 'stagetrain\[wandb\]'"
    )
    with pytest.raises(StageError, match=pattern) as launcher:  # the launcher, before any rank
        trackers(tracking("tensorboard", "wandb"), tmp_path, "pretrain")
    wandb = {"project": "p", "name": "tiny-grpo", "dir": str(tmp_path / "wandb")}
    with pytest.raises(StageError, match=pattern) as rank:  # a rank given such a spec
        MetricsLog(tmp_path / "grpo/fp/metrics.jsonl", 0, METRICS, wandb=wandb)
    assert "\n" not in str(launcher.value) + str(rank.value)


def test_wandb_offline_gets_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real offline run holds the scalars (wandb is a test dependency, not the pipeline's)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    found = trackers(tracking("wandb"), tmp_path / "tiny", "grpo")
    metrics = MetricsLog(tmp_path / "ck/grpo/fp/metrics.jsonl", 0, METRICS, wandb=found["wandb"])
    for step in (1, 2):
        metrics.write({"step": step, "train/loss": 0.5 / step, "reward/mean": 0.1 * step})
    metrics.close()
    wandb.teardown()  # the service flushes its files when it stops, as at a rank's exit
    runs = list((tmp_path / "tiny/wandb/wandb").glob("offline-run-*-tiny-grpo-fp"))
    assert len(runs) == 1, list((tmp_path / "tiny/wandb").rglob("*"))[:20]
    # The offline run's record file (protobuf) holds the logged keys by name.
    data = (runs[0] / "run-tiny-grpo-fp.wandb").read_bytes()
    assert b"train/loss" in data and b"reward/mean" in data


# --- MLflow -------------------------------------------------------------------------------------


def test_mlflow_without_a_uri_or_the_package_is_one_line_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tracking URI anywhere: MLflow would write ./mlruns wherever the rank runs, so the
    launcher refuses, naming the key; without the package, the pip command."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(
        StageError, match=r"^tracking\.mlflow\.tracking_uri: not set, nor MLFLOW_TRACKING_URI"
    ):
        trackers(tracking("mlflow"), tmp_path, "pretrain")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(
        StageError,
        match=r"^tracking\.report_to: 'mlflow' needs the mlflow package.*stagetrain\[mlflow\]",
    ):
        trackers(tracking("mlflow", tracking_uri="http://127.0.0.1:1"), tmp_path, "pretrain")  # fmt: skip


def test_an_mlflow_server_that_does_not_answer_is_one_line_at_once(tmp_path: Path) -> None:
    """MLflow's client retries a refused connection for about two minutes by default: the
    launcher asks once, and says which URI did not answer, before any rank starts."""
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    began = time.monotonic()
    with pytest.raises(
        StageError, match=rf"^tracking\.mlflow\.tracking_uri: {uri}: MLflow did not answer"
    ) as err:
        trackers(tracking("mlflow", tracking_uri=uri), tmp_path, "grpo")  # fmt: skip
    assert "\n" not in str(err.value) and time.monotonic() - began < 30


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real MLflow server for this module's tests (its start takes 10-20 s)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def history(client: Any, run_id: str) -> dict[str, dict[int, list[float]]]:
    """Every metric of a run: key -> step -> the values logged at it."""
    run = client.get_run(run_id)
    out: dict[str, dict[int, list[float]]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run_id, key):
            out.setdefault(key, {}).setdefault(point.step, []).append(point.value)
    return out


def expected(records: list[dict[str, Any]]) -> dict[str, dict[int, list[float]]]:
    """What a run that holds `records` (metrics.jsonl's) once each holds."""
    out: dict[str, dict[int, list[float]]] = {}
    for record in records:
        for key, value in scalars(record).items():
            out.setdefault(metric_name(key), {})[record["step"]] = [value]
    return out


def the_run(client: Any, experiment: str, name: str) -> Any:
    found = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], f"attributes.run_name = '{name}'"
    )
    assert len(found) == 1, [r.info.run_name for r in found]
    return found[0]


@pytest.mark.slow
def test_mlflow_gets_each_record_a_resume_continues_the_run_and_a_new_run_gets_the_history(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """The stage log's own path (MetricsLog, as rank 0 opens it), on a real server: records at
    their steps, params from the part; a resume at step 2 continues the same run (no second
    run); a run turned on after the stage began (another experiment) starts with the records
    metrics.jsonl kept, so it holds the whole history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    found = trackers(
        tracking("mlflow", tracking_uri=mlflow_uri, experiment="unit"), tmp_path / "tiny", "grpo"
    )
    spec = job_spec(inputs={}, outputs={}, checkpoints=tmp_path, part=grpo_part(default_config()), **found)  # fmt: skip
    run = spec["mlflow"]
    assert run["params"]["grpo.group_size"] == str(default_config()["grpo"]["group_size"])
    path = tmp_path / "ck/grpo/fp/metrics.jsonl"
    records = [
        {"step": s, "train/loss": 0.5 / s, "rewards": {"correct": {"mean": 0.1 * s}}}
        for s in (1, 2, 3)
    ]
    metrics = MetricsLog(path, 0, METRICS, mlflow=run)
    for record in records:
        metrics.write(record)  # type: ignore[arg-type]  # a GRPO record's keys, a few of them
    metrics.close()
    first = the_run(client, "unit", "tiny-grpo")
    assert history(client, first.info.run_id) == expected(records)
    assert first.data.params["grpo.group_size"] == run["params"]["grpo.group_size"]
    assert first.data.tags["stagetrain.run"] == "tiny-grpo-fp" and first.info.status == "FINISHED"

    resumed = MetricsLog(path, 2, METRICS, mlflow=run)  # killed after step 2's checkpoint
    resumed.write({"step": 3, "train/loss": 0.25})  # type: ignore[typeddict-unknown-key]
    resumed.close()
    again = the_run(client, "unit", "tiny-grpo")
    assert again.info.run_id == first.info.run_id
    assert history(client, again.info.run_id)["train/loss"][3] == [
        0.5 / 3,
        0.25,
    ]  # MLflow keeps both

    later = MetricsLog(path, 3, METRICS, mlflow={**run, "experiment": "later"})
    later.close()
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert history(client, the_run(client, "later", "tiny-grpo").info.run_id) == expected(kept)


@pytest.mark.slow
def test_mlflow_holds_both_stages_metrics_their_params_and_each_consolidated_model(
    finished_copy: Path, mlflow_uri: str
) -> None:
    """MLflow turned on for a finished run, through Snakemake: both training stages resume at
    their last checkpoint (their runs are new, so they get metrics.jsonl's records; the test
    above sends records as they are written), and each consolidated folder is logged as the
    `model/` artifact of its stage's run, file for file. The run's own metrics.jsonl files
    are the reference."""
    from mlflow.tracking import MlflowClient

    edit_config(finished_copy, "tracking", report_to=["tensorboard", "mlflow"],
                mlflow={"tracking_uri": mlflow_uri, "experiment": "pipeline"})  # fmt: skip
    run = finished_copy / "results/tiny"
    snakemake(finished_copy)
    client = MlflowClient(mlflow_uri)
    for stage in ("pretrain", "grpo"):
        found = the_run(client, "pipeline", f"tiny-{stage}")
        records = [
            json.loads(line) for line in (run / stage / "metrics.jsonl").read_text().splitlines()
        ]
        logged = history(client, found.info.run_id)
        assert records and logged == expected(records), stage
        if stage == "pretrain":  # memory/max_rss(GiB), as MLflow's names allow
            assert "memory/max_rss_GiB" in logged
        assert found.info.status == "FINISHED"
        assert f"{stage}.steps" in found.data.params
        folder = run / "model" / stage
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                       and not p.name.startswith(".snakemake"))  # fmt: skip
        artifacts: list[str] = []
        todo = ["model"]
        while todo:
            for item in client.list_artifacts(found.info.run_id, todo.pop()):
                (todo if item.is_dir else artifacts).append(item.path)
        assert sorted(p.removeprefix("model/") for p in artifacts) == files, stage
        copy = client.download_artifacts(
            found.info.run_id, "model/config.json", str(finished_copy / stage)
        )
        assert Path(copy).read_bytes() == (folder / "config.json").read_bytes()
