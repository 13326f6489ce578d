"""Pure parts of the pretrain stage: data order, launch commands, checkpoint fingerprints, metrics."""

from __future__ import annotations

import json
import logging
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.checkpoints import fake_checkpoint

from stagetrain.errors import StageError
from stagetrain.pretrain.metrics import METRICS
from stagetrain.training.batches import Sampler, read_windows, window_count
from stagetrain.training.checkpoints import Checkpoints, fingerprint
from stagetrain.training.metrics import MetricsLog


def _sampler(**changes: int) -> Sampler:
    return Sampler(
        **{"windows": 100, "global_batch": 8, "dp": 2, "micro_batch_size": 2, "seed": 1, **changes}
    )


def test_ranks_read_disjoint_samples_and_an_epoch_uses_each_once() -> None:
    sampler = _sampler(windows=96)  # 12 steps per epoch
    seen = []
    for step in range(12):
        per_rank = [np.concatenate(sampler.rank_micro_batches(step, r)) for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert all(len(m) == 2 for r in range(2) for m in sampler.rank_micro_batches(step, r))
        seen.extend(np.concatenate(per_rank).tolist())
    assert sorted(seen) == list(range(96))


def test_epochs_carry_over_when_the_batch_does_not_divide_them() -> None:
    sampler = _sampler(windows=100)
    stream = np.concatenate([sampler.step_windows(s) for s in range(25)])  # 200 = two epochs
    assert sorted(stream[:100].tolist()) == list(range(100))
    assert sorted(stream[100:].tolist()) == list(range(100))
    assert not np.array_equal(stream[:100], stream[100:])  # a new permutation each epoch


def test_data_position_is_the_step() -> None:
    """A restarted run (a new Sampler) reads exactly what the first would have read."""
    first, second = _sampler(), _sampler()
    for step in (0, 7, 31):
        for rank in range(2):
            assert all(np.array_equal(a, b) for a, b in zip(first.rank_micro_batches(step, rank),
                                                              second.rank_micro_batches(step, rank), strict=True))  # fmt: skip
    assert not np.array_equal(_sampler(seed=2).step_windows(0), first.step_windows(0))


def test_global_batch_is_the_same_whatever_the_split() -> None:
    """2 ranks x micro 2 x accumulation 2 and 1 rank x micro 4 x accumulation 2 read the same windows per step."""
    two = _sampler(dp=2, micro_batch_size=2)
    one = _sampler(dp=1, micro_batch_size=4)
    for step in range(5):
        a = np.concatenate([np.concatenate(two.rank_micro_batches(step, r)) for r in range(2)])
        b = np.concatenate(one.rank_micro_batches(step, 0))
        assert np.array_equal(a, b)


def test_windows_and_too_little_data() -> None:
    shard = np.arange(100, dtype=np.uint16)
    assert window_count(100, 10) == 9
    windows = read_windows(shard, np.array([0, 3]), 10)
    assert windows.dtype == np.int64 and windows.tolist() == [
        list(range(0, 11)),
        list(range(30, 41)),
    ]
    with pytest.raises(ValueError, match="holds 4 windows, fewer than one global batch of 8"):
        _sampler(windows=4)


def test_every_epoch_uses_each_window_once_across_many_epoch_boundaries() -> None:
    """5 windows, batches of 3: most steps straddle an epoch boundary, later ones far from the
    first epoch's; every 5 consecutive items of the stream are still one epoch's permutation."""
    for seed in range(3):
        sampler = _sampler(windows=5, global_batch=3, dp=1, micro_batch_size=3, seed=seed)
        stream = np.concatenate([sampler.step_windows(s) for s in range(10)])  # 6 epochs
        epochs = [stream[e * 5 : (e + 1) * 5].tolist() for e in range(6)]
        assert all(sorted(epoch) == list(range(5)) for epoch in epochs), epochs


def test_a_rank_whose_share_is_not_a_whole_number_of_micro_batches_reads_only_its_share() -> None:
    """Batches of 6 over 2 ranks in micro batches of 2: each rank's 3 windows are a micro batch
    of 2 and one of 1, and the ranks' shares in rank order are the step's batch, none twice."""
    sampler = _sampler(windows=20, global_batch=6, dp=2, micro_batch_size=2)
    for step in range(4):
        shares = [sampler.rank_micro_batches(step, r) for r in range(2)]
        assert [[len(m) for m in share] for share in shares] == [[2, 1], [2, 1]]
        joined = np.concatenate([m for share in shares for m in share])
        assert np.array_equal(joined, sampler.step_windows(step))


def test_a_shard_of_exactly_one_global_batch_is_enough() -> None:
    assert len(_sampler(windows=8).step_windows(3)) == 8


def test_a_window_needs_seq_len_plus_one_tokens() -> None:
    """Windows step by seq_len and each needs one token more, so seq_len tokens hold none."""
    assert [window_count(tokens, 10) for tokens in (0, 1, 10, 11, 20, 21, 31)] == [
        0,
        0,
        0,
        1,
        1,
        2,
        3,
    ]


def test_fingerprint_follows_the_maths(tmp_path: Path) -> None:
    base = {"training": {"lr": 1e-3}, "seed": 1}
    assert fingerprint(base) == fingerprint(dict(reversed(base.items())))
    assert fingerprint(base) != fingerprint({**base, "seed": 2})
    old = Checkpoints(tmp_path, base, {"dp": 2, "tp": 1, "zero_stage": 0}, keep=2)
    old.folder.mkdir(parents=True)
    (old.folder / "components.json").write_text(json.dumps(base))
    new = Checkpoints(
        tmp_path, {**base, "training": {"lr": 2e-3}}, {"dp": 2, "tp": 1, "zero_stage": 0}, keep=2
    )
    assert (
        new.why_fresh()
        == f"config changed since checkpoint {old.folder.name} (training): starting fresh"
    )
    assert new.latest() is None


def test_a_zero0_checkpoint_resumes_under_another_dp_and_is_refused_under_another_stage(
    tmp_path: Path,
) -> None:
    ckpt = Checkpoints(tmp_path, {"seed": 1}, {"dp": 2, "tp": 1, "zero_stage": 0}, keep=2)
    fake_checkpoint(ckpt.folder, 4, {"dp": 2, "tp": 1, "zero_stage": 0})
    (ckpt.folder / "latest.json").write_text(
        json.dumps(
            {"tag": "step00000004", "step": 4, "layout": {"dp": 2, "tp": 1, "zero_stage": 0}}
        )
    )
    assert ckpt.latest()["step"] == 4
    other = Checkpoints(tmp_path, {"seed": 1}, {"dp": 1, "tp": 1, "zero_stage": 0}, keep=2)
    assert other.latest()["load_tag"] == "step00000004"  # the model file holds the whole state
    zero2 = Checkpoints(tmp_path, {"seed": 1}, {"dp": 1, "tp": 1, "zero_stage": 2}, keep=2)
    with pytest.raises(
        StageError, match="a ZeRO-0 checkpoint resumes only under ZeRO-0 with the same tp"
    ):
        zero2.latest()


def test_metrics_log_keeps_only_registered_keys_and_truncates_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, resume_step=0, registry=METRICS)
    for step in range(1, 6):
        log.write({"step": step, "train/loss": 1.0 / step})
    with pytest.raises(KeyError, match="not in the registry"):
        log.write({"step": 6, "loss": 0.1})
    MetricsLog(path, resume_step=3, registry=METRICS)  # a restart from the step-3 checkpoint
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert all("/" in key or key == "step" for key in METRICS)


@pytest.mark.parametrize("stage", ["pretrain", "grpo"])
def test_the_record_type_names_every_registered_metric(stage: str) -> None:
    """A stage's record TypedDict and its registry of metric names hold the same keys."""
    from stagetrain.grpo.metrics import METRICS as GRPO_METRICS
    from stagetrain.grpo.metrics import GrpoRecord
    from stagetrain.pretrain.metrics import PretrainRecord

    record, registry = (
        (PretrainRecord, METRICS) if stage == "pretrain" else (GrpoRecord, GRPO_METRICS)
    )
    assert set(record.__annotations__) == set(registry)
    assert "step" in record.__required_keys__


def test_a_torn_last_metrics_line_is_dropped_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk or a kill mid-append leaves half a line; every resume failed on it."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, resume_step=0, registry=METRICS)
    for step in range(1, 4):
        log.write({"step": step, "train/loss": 1.0 / step})
    with open(path, "a") as handle:
        handle.write('{"step": 4, "train/lo')
    with caplog.at_level(logging.WARNING, logger="stagetrain"):
        MetricsLog(path, resume_step=3, registry=METRICS)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert "its last line is torn" in caplog.text


def test_ranks_get_their_share_of_the_cores_whatever_snakemake_set() -> None:
    from stagetrain.training.launch import THREAD_VARIABLES, rank_environment

    env = rank_environment(
        {"OMP_NUM_THREADS": "16", "MKL_NUM_THREADS": "16", "PATH": "/bin"},
        cores=16,
        ranks_per_node=8,
    )
    assert all(env[v] == "2" for v in THREAD_VARIABLES) and env["PATH"] == "/bin"
    assert rank_environment({}, cores=2, ranks_per_node=4)["OMP_NUM_THREADS"] == "1"


def test_metrics_reach_tensorboard_and_a_resume_replaces_the_steps_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stagetrain.grpo.metrics import METRICS as GRPO_METRICS

    events = tmp_path / "tensorboard"
    first = MetricsLog(tmp_path / "m.jsonl", 0, GRPO_METRICS, events)
    for step in range(1, 5):
        first.write({"step": step, "train/loss": float(step), "curriculum/level": {"counting": 1}})
    second = MetricsLog(tmp_path / "m.jsonl", 2, GRPO_METRICS, events)  # resumed at step 2
    for step in (3, 4):
        second.write(
            {"step": step, "train/loss": 10.0 * step, "curriculum/events": [{"kind": "x"}]}
        )
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    assert [e.step for e in acc.Scalars("curriculum/level/counting")] == [1, 2]
    assert "curriculum/events" not in acc.Tags()["scalars"]


def test_metrics_without_tensorboard_installed_log_the_reason_and_keep_the_json_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The GPU check's machine has no tensorboard: training must go on without event files.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    metrics = MetricsLog(tmp_path / "m.jsonl", 0, METRICS, events=tmp_path / "tensorboard")
    metrics.write({"step": 1, "train/loss": 2.0})
    assert json.loads((tmp_path / "m.jsonl").read_text())["train/loss"] == 2.0
    assert not (tmp_path / "tensorboard").exists()
    assert "no TensorBoard event files" in caplog.text


def test_the_collective_timeout_is_bounded_and_checked() -> None:
    from datetime import timedelta

    from stagetrain.training.engine import COLLECTIVE_TIMEOUT_S, collective_timeout

    assert collective_timeout({}) == timedelta(seconds=COLLECTIVE_TIMEOUT_S) < timedelta(minutes=30)
    assert collective_timeout({"STAGETRAIN_COLLECTIVE_TIMEOUT_S": "20"}) == timedelta(seconds=20)
    with pytest.raises(
        StageError, match="STAGETRAIN_COLLECTIVE_TIMEOUT_S: expected a whole number"
    ):
        collective_timeout({"STAGETRAIN_COLLECTIVE_TIMEOUT_S": "1.5"})


PEER = """
import sys, time
import deepspeed.comm
import torch, torch.distributed as dist
from stagetrain.training.engine import join_world
folder = sys.argv[1]
join_world({k: f"{folder}/{k}.json" for k in ("plan", "meta", "deepspeed_config")})  # the stages' start
group = deepspeed.comm.new_group([0, 1])  # as DeepSpeed makes its gradient-reduction group: no timeout
if dist.get_rank() == 1:
    time.sleep(60)  # alive, connections open, never reduces: a peer behind a dead link
else:
    print("reducing", flush=True)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError:
        print(f"gave up after {time.monotonic() - began:.1f} s", flush=True)
"""


def test_a_group_made_after_the_world_times_out_as_the_world_does(tmp_path: Path) -> None:
    """Two gloo processes started by the stages' own `join_world`: rank 1 never joins rank 0's
    all-reduce on a group DeepSpeed made without a timeout; rank 0 gives up after the collective
    timeout (3 s here), not torch's 30-minute default (without `bound_every_group` in
    `join_world` it waited until rank 1 exited)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, doc in {
        "plan": {"backend": "gloo", "world": 2},
        "meta": {},
        "deepspeed_config": {},
    }.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "STAGETRAIN_COLLECTIVE_TIMEOUT_S": "3"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path)], env={**env, "RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for r in (0, 1)]  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in procs[0].stdout], daemon=True
    ).start()  # type: ignore[union-attr]
    try:
        # Starting two processes that import torch and DeepSpeed takes what the machine's load
        # makes it; the guarantee is timed from the all-reduce on, by rank 0 itself.
        while lines.get(timeout=600).strip() != "reducing":  # DeepSpeed logs on stdout first
            pass
        out = lines.get(timeout=30)  # 3 s asked; torch's default would be 30 minutes
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    seconds = float(out.split("gave up after ")[1].split()[0])
    assert 2.5 < seconds < 20, out


@pytest.mark.parametrize(
    ("change", "kind", "first"),
    [
        ({"num_hidden_layers": 5}, "missing", "model.layers.4.input_layernorm.weight"),
        ({"num_hidden_layers": 3}, "unexpected", "model.layers.3.input_layernorm.weight"),
        ({"intermediate_size": 48}, "mismatched", "model.layers.0.mlp.down_proj.weight"),
    ],
    ids=["a-layer-missing", "a-layer-too-many", "a-shape-wrong"],
)
def test_init_from_weights_that_do_not_match_their_config_are_one_line(
    tmp_path: Path, change: dict[str, int], kind: str, first: str
) -> None:
    """transformers only warns about them, and a missing fifth layer stayed random, was trained,
    consolidated and 'verified'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stagetrain.training.engine import load_pretrained

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    load_pretrained(str(tmp_path))  # as saved: loads
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, **change}))
    with pytest.raises(StageError) as err:
        load_pretrained(str(tmp_path))
    assert str(err.value).startswith(f"model.init_from: {tmp_path}: ") and "\n" not in str(
        err.value
    )
    assert f" {kind} weight(s) against its config.json, the first {first!r}" in str(err.value)


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this ran",))


@pytest.mark.parametrize("damage", ["truncated-safetensors", "pickle-that-runs-code"])
def test_a_damaged_or_unsafe_init_from_weight_file_is_one_line_naming_it(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both were tracebacks from safetensors or torch inside the ranks; the pickle's never ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stagetrain.training.engine import load_pretrained

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage == "truncated-safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        expected = (
            re.escape(f"model.init_from: {weights}: does not read as safetensors (")
            + ".*not fully covered"
        )
    else:
        weights.unlink()
        torch.save({**model.state_dict(), "extra": _RunsCode()}, tmp_path / "pytorch_model.bin")
        expected = re.escape(
            f"model.init_from: {tmp_path}: a .bin weight file was refused: loading it would run code (GLOBAL print)"
        )
    with pytest.raises(StageError, match=expected) as err:
        load_pretrained(str(tmp_path))
    assert "\n" not in str(err.value) and "this ran" not in capsys.readouterr().out


def test_a_rank_joins_without_building_deepspeeds_inference_comm_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSpeed's torch backend compiles its CPU shared-memory all-reduce (minutes, with g++)
    as a rank joins, for inference alone; the stages' join tells it the op is not there. The op
    is made available first, so that the test holds on a machine without a compiler too."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from stagetrain.training.engine import skip_inference_comm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip("this accelerator has no shared-memory comm op")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, True)
    monkeypatch.setattr(type(builder), "load", lambda *_, **__: pytest.fail("the op was built"))
    skip_inference_comm_op()
    assert build_shm_op() is None


def test_a_rank_joins_without_probing_every_deepspeed_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed probes every op it has (g++ compiles, package-manager queries) the first time
    its comm op's check reads the availability dict; a stage's rank makes that dict itself."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from stagetrain.training.engine import skip_inference_comm_op

    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__", raising=False)
    monkeypatch.setattr(deepspeed.ops, "_probe_compatible_ops", lambda: pytest.fail("probed"))
    skip_inference_comm_op()
    assert build_shm_op() is None
    assert deepspeed.ops.__compatible_ops__ == {"deepspeed_shm_comm": False}


def test_bad_input_met_by_every_rank_is_one_line_not_torchruns_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks under torchrun meet the same bad row: the log has the line once and none of
    torchrun's ChildFailedError report (which repeated it inside a traceback), and the stage's
    error is that line."""
    import os

    from stagetrain.errors import StageError
    from stagetrain.training.launch import run_ranks

    spec = tmp_path / "spec.json"
    (tmp_path / "barrier").mkdir()
    spec.write_text(json.dumps({"file": "tasks/t.jsonl", "barrier": str(tmp_path / "barrier")}))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [
        torchrun,
        "--standalone",
        "--nproc_per_node",
        "2",
        "tests/dist/bad_input_rank.py",
        "--spec",
        str(spec),
    ]
    with caplog.at_level("INFO", logger="stagetrain"), pytest.raises(StageError) as err:
        run_ranks(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, "grpo")
    line = "tasks/t.jsonl:12: reward f: returned 'x'; expected a finite number or None"
    assert str(err.value) == line
    logged = [r.getMessage() for r in caplog.records]
    assert logged.count(f"error: {line}") == 1, logged
    assert not [
        m
        for m in logged
        if "ChildFailedError" in m or "Traceback" in m or m.count(line) and m != f"error: {line}"
    ]


def test_progress_gives_the_eta_from_the_steps_this_process_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both training stages' console line: a run resumed at step 40 of 100 that took 30 s for
    10 steps has 50 to go, 150 s; the steps before the resume took no time here."""
    from stagetrain.training import metrics as metrics_module

    clock = iter([1000.0, 1030.0])
    fake = type("Clock", (), {"monotonic": staticmethod(lambda: next(clock)), "strftime": time.strftime,
                              "gmtime": time.gmtime})  # fmt: skip
    monkeypatch.setattr(
        metrics_module, "time", fake
    )  # this module's clock alone, not the process's
    progress = metrics_module.Progress(100, 40)
    assert progress.line(50, 1.5, 2000.0) == "step 50/100 loss 1.5000 tokens/s 2,000 ETA 00:02:30"
