"""resize_embeddings: old rows kept exactly, new rows around the old mean, tied stays tied, ZeRO-3 too.

The single-process tests use the default tiny Llama built from scratch with 300 rows and
grow it to 320. The slow test runs tests/dist/resize_zero3.py on two CPU ranks under
torchrun, with the model built under deepspeed.zero.Init (parameters partitioned), and
asserts on what each rank wrote.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.configs import model_settings
from harness.workflow import REPO, default_config
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from stagetrain.errors import StageError
from stagetrain.model.config import build_config
from stagetrain.model.embeddings import embedding_rows, resize_embeddings

OLD_ROWS, NEW_ROWS = 300, 320
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DIST_SCRIPT = REPO / "tests" / "dist" / "resize_zero3.py"

# transformers' mean_resizing draws new rows from N(mean, 1e-9 * covariance of the old rows).
# The old rows are N(0, 0.02) (initializer_range), so a new row lies about
# sqrt(1e-9) * 0.02 = 6e-7 per dimension from the old mean (2.5e-6 at most over 20 x 128
# draws), while a default N(0, 0.02) row would lie about 0.02 from it. MEAN_ATOL sits 40x
# above the first and 200x below the second.
MEAN_ATOL = 1e-4
COVARIANCE_SCALE = 1e-9


def tiny_model(*, tied: bool = True, seed: int = 0) -> PreTrainedModel:
    """The default config's model, from scratch with OLD_ROWS rows; same seed, same weights."""
    section = {**default_config()["model"], "tie_word_embeddings": tied}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config(model_settings(section), OLD_ROWS))


def weights(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the input embedding and the output projection."""
    return (
        model.get_input_embeddings().weight.detach().clone(),
        model.get_output_embeddings().weight.detach().clone(),
    )


def assert_near_old_mean(new_rows: torch.Tensor, old: torch.Tensor) -> None:
    """Every new row is within MEAN_ATOL of the old rows' mean, in every dimension."""
    deviation = (new_rows - old.mean(dim=0)).abs().max().item()
    assert deviation < MEAN_ATOL, f"new rows lie {deviation:.3g} from the old mean"


def test_tied_model_grows_keeps_old_rows_and_stays_tied() -> None:
    """Tied: True returned, first 300 rows bit-identical, 20 new rows at the old mean, still one tensor."""
    model = tiny_model(tied=True)
    old_in, _ = weights(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert embedding_rows(model) == OLD_ROWS

    assert resize_embeddings(model, NEW_ROWS, seed=1) is True

    new_in, new_out = weights(model)
    assert new_in.shape == (NEW_ROWS, old_in.shape[1])
    assert torch.equal(new_in[:OLD_ROWS], old_in)
    assert_near_old_mean(new_in[OLD_ROWS:], old_in)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(new_out, new_in)
    assert model.get_output_embeddings().out_features == NEW_ROWS
    assert embedding_rows(model) == NEW_ROWS
    assert model.config.vocab_size == NEW_ROWS


def test_untied_model_grows_both_input_and_output() -> None:
    """Untied: input and output both grow, each keeps its own old rows and starts at its own mean."""
    model = tiny_model(tied=False)
    old_in, old_out = weights(model)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight

    assert resize_embeddings(model, NEW_ROWS, seed=1) is True

    new_in, new_out = weights(model)
    assert new_in.shape[0] == new_out.shape[0] == NEW_ROWS
    assert torch.equal(new_in[:OLD_ROWS], old_in)
    assert torch.equal(new_out[:OLD_ROWS], old_out)
    assert_near_old_mean(new_in[OLD_ROWS:], old_in)
    assert_near_old_mean(new_out[OLD_ROWS:], old_out)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.get_output_embeddings().out_features == NEW_ROWS
    assert model.config.vocab_size == NEW_ROWS


def test_new_rows_follow_the_old_covariance() -> None:
    """New rows spread along the old rows' principal axes as N(mean, 1e-9 * cov) would, not evenly.

    400 new rows: their variance along the old covariance's largest and smallest eigenvectors
    is compared with 1e-9 times those eigenvalues (chi-square with 400 degrees of freedom:
    within 0.6-1.6 with a huge margin). The two eigenvalues differ about 20x, so an isotropic
    draw, or every row set to the mean, fails.
    """
    model = tiny_model(tied=True)
    old, _ = weights(model)
    assert resize_embeddings(model, OLD_ROWS + 400, seed=3)
    new_rows = model.get_input_embeddings().weight.detach()[OLD_ROWS:]

    centered = old - old.mean(dim=0)
    eigenvalues, eigenvectors = torch.linalg.eigh(centered.T @ centered / OLD_ROWS)
    assert eigenvalues[-1] / eigenvalues[0] > 5
    spread = new_rows - old.mean(dim=0)
    for index in (0, -1):
        expected = COVARIANCE_SCALE * eigenvalues[index].item()
        measured = (spread @ eigenvectors[:, index]).pow(2).mean().item()
        assert 0.6 < measured / expected < 1.6, (index, measured, expected)


def test_same_size_is_a_no_op() -> None:
    """Resizing to the current size returns False and leaves every weight and the config alone."""
    model = tiny_model(tied=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    weight = model.get_input_embeddings().weight

    assert resize_embeddings(model, OLD_ROWS, seed=1) is False

    assert model.get_input_embeddings().weight is weight
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert model.config.vocab_size == OLD_ROWS


def test_shrinking_is_refused() -> None:
    """Fewer rows than the model has: StageError naming both sizes, the model untouched."""
    model = tiny_model(tied=True)
    old_in, _ = weights(model)
    with pytest.raises(StageError, match=r"300 rows, more than the 299 asked"):
        resize_embeddings(model, OLD_ROWS - 1, seed=1)
    assert torch.equal(model.get_input_embeddings().weight, old_in)
    assert model.config.vocab_size == OLD_ROWS


class Wrapper(nn.Module):
    """An nn.Module around the model, as DeepSpeedEngine or DDP are."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class EngineStandIn:
    """Not a module at all: something with a `.module`, standing for an engine."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


@pytest.mark.parametrize("wrap", [Wrapper, EngineStandIn], ids=["nn-module", "engine-like"])
def test_wrapped_model_is_refused(wrap: type) -> None:
    """Anything but an unwrapped PreTrainedModel: StageError telling to resize before deepspeed.initialize."""
    model = tiny_model(tied=True)
    with pytest.raises(StageError, match=r"got (Wrapper|EngineStandIn).*deepspeed\.initialize"):
        resize_embeddings(wrap(model), NEW_ROWS, seed=1)
    assert embedding_rows(model) == OLD_ROWS


def test_seed_decides_the_new_rows_and_global_rng_is_untouched() -> None:
    """Same seed, same new rows (so ranks agree); another seed, other rows; the caller's RNG unchanged."""
    new_rows = {}
    for label, seed in (("a", 11), ("b", 11), ("c", 12)):
        model = tiny_model(tied=False)
        state = torch.get_rng_state()
        resize_embeddings(model, NEW_ROWS, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)
        new_in, new_out = weights(model)
        new_rows[label] = (new_in[OLD_ROWS:], new_out[OLD_ROWS:])
    assert all(torch.equal(x, y) for x, y in zip(new_rows["a"], new_rows["b"], strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(new_rows["a"], new_rows["c"], strict=True))


def test_hf_deepspeed_config_can_be_built() -> None:
    """The HfDeepSpeedConfig that the ZeRO-3 path needs alive can be built, and is seen while alive.

    transformers refuses to build one without accelerate>=1.1 (it checks the distribution at
    construction), so this pins that the environment has it.
    """
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        try:
            dschf = HfDeepSpeedConfig(
                {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
            )
        except importlib.metadata.PackageNotFoundError as err:
            pytest.fail(f"HfDeepSpeedConfig cannot be built (is accelerate installed?): {err}")
        assert is_deepspeed_zero3_enabled()
        del dschf
        gc.collect()
        assert not is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()  # a half-built one must not leak into other tests


# --- two CPU ranks, ZeRO-3 -------------------------------------------------------------


def run_ranks(out: Path, tied: bool) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Run resize_zero3.py on two ranks; each rank's (record, tensors). Fails with its output."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(DIST_SCRIPT), str(out)]
    proc = subprocess.run(
        [*command, "1" if tied else "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return [
        (
            json.loads((out / f"rank{rank}.json").read_text()),
            torch.load(out / f"rank{rank}.pt"),
        )
        for rank in (0, 1)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_resize_under_zero3_on_two_ranks(tmp_path: Path, tied: bool) -> None:
    """A model built partitioned under zero.Init resizes correctly on both ranks and trains.

    Proves: each rank held half of the embedding after construction; the gathered old rows
    are bit-identical to the first 300 new rows on both ranks; both ranks hold identical new
    weights; new rows sit at the old mean; 320 rows and the config agree; tied stays tied;
    deepspeed.initialize re-partitions the grown weights without changing them and one AdamW
    step gives a finite loss and moves the new rows; an engine, and a partitioned model
    without a live HfDeepSpeedConfig, are refused and left as they were.
    """
    ranks = run_ranks(tmp_path, tied)
    (record0, tensors0), (record1, tensors1) = ranks

    for rank, (record, tensors) in enumerate(ranks):
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["zero3_enabled"] is True
        for side in ("input", "output"):
            built = record["built"][side]
            assert built["partitioned"] and built["shape"] == [OLD_ROWS, 128]
            assert built["visible_numel"] == 0
            assert built["local"] == built["total"] // 2 == OLD_ROWS * 128 // 2
        assert record["built_tied"] is tied
        assert record["rows_before"] == OLD_ROWS

        assert record["changed"] is True
        assert record["rows_after"] == record["config_vocab_size"] == NEW_ROWS
        assert record["lm_head_out_features"] == NEW_ROWS
        assert record["tied_after"] is tied and record["tied_wrapped"] is tied
        assert torch.equal(tensors["new_input"][:OLD_ROWS], tensors["old_input"])
        assert torch.equal(tensors["new_output"][:OLD_ROWS], tensors["old_output"])
        assert_near_old_mean(tensors["new_input"][OLD_ROWS:], tensors["old_input"])
        assert_near_old_mean(tensors["new_output"][OLD_ROWS:], tensors["old_output"])
        if tied:
            assert torch.equal(tensors["new_output"], tensors["new_input"])

        # deepspeed.initialize partitions the grown weights again, values unchanged.
        for side in ("input", "output"):
            wrapped = record["wrapped"][side]
            assert wrapped["partitioned"] and wrapped["shape"] == [NEW_ROWS, 128]
            assert wrapped["local"] == wrapped["total"] // 2
            assert torch.equal(tensors[f"wrapped_{side}"], tensors[f"new_{side}"])
        assert torch.isfinite(torch.tensor(record["loss"]))
        changed = (tensors["stepped_input"] != tensors["wrapped_input"]).any(dim=1)
        assert changed[OLD_ROWS:].all(), "the step did not move the new rows"

        assert "deepspeed.initialize" in record["engine_refused"]
        assert record["zero3_enabled_after_del"] is False
        for case in ("orphan", "bare"):
            assert record[f"{case}_partitioned"] is True
            assert "no HfDeepSpeedConfig is alive" in record[f"{case}_refused"]
            assert record[f"{case}_rows"] == OLD_ROWS

    assert record0["loss"] == record1["loss"]
    assert tensors0.keys() == tensors1.keys()
    for name in tensors0:
        assert torch.equal(tensors0[name], tensors1[name]), f"ranks differ on {name}"
