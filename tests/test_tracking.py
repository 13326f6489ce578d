"""Trackers beside metrics.jsonl: TensorBoard by default, Weights & Biases only when asked and installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness.workflow import default_config

from stagetrain.config.settings import TrackingSettings
from stagetrain.errors import StageError
from stagetrain.grpo.metrics import METRICS
from stagetrain.training.launch import grpo_part, job_spec, trackers
from stagetrain.training.metrics import MetricsLog


def test_tensorboard_is_on_and_wandb_off_by_default(tmp_path: Path) -> None:
    config = default_config()
    tracking = TrackingSettings.from_config(config["tracking"], "tracking")
    assert tracking.report_to == ("tensorboard",)
    found = trackers(tracking, tmp_path / "results/tiny", "pretrain")
    assert found == {"tensorboard": tmp_path / "results/tiny/tensorboard/pretrain", "wandb": None}
    spec = job_spec(inputs={}, outputs={}, checkpoints=tmp_path, part=grpo_part(config), **found)
    assert "wandb" not in spec and spec["tensorboard"].endswith("tensorboard/pretrain")


def test_an_empty_report_to_writes_no_events(tmp_path: Path) -> None:
    found = trackers(TrackingSettings(report_to=(), wandb_project="p"), tmp_path, "grpo")
    assert found == {"tensorboard": None, "wandb": None}


def test_wandb_without_the_package_is_one_line_naming_the_key_and_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import raises
    tracking = TrackingSettings(report_to=("tensorboard", "wandb"), wandb_project="p")
    pattern = (
        r"^tracking\.report_to: 'wandb' needs the wandb package.*pip install 'stagetrain\[wandb\]'"
    )
    with pytest.raises(StageError, match=pattern) as launcher:  # the launcher, before any rank
        trackers(tracking, tmp_path, "pretrain")
    wandb = {"project": "p", "name": "tiny-grpo", "dir": str(tmp_path / "wandb")}
    with pytest.raises(StageError, match=pattern) as rank:  # a rank given such a spec
        MetricsLog(tmp_path / "grpo/fp/metrics.jsonl", 0, METRICS, wandb=wandb)
    assert "\n" not in str(launcher.value) + str(rank.value)


def test_wandb_offline_gets_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real offline run holds the scalars (wandb is a test dependency, not the pipeline's)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    found = trackers(
        TrackingSettings(report_to=("wandb",), wandb_project="p"), tmp_path / "tiny", "grpo"
    )
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
