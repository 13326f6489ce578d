"""The consolidate stage: from real two-rank DeepSpeed checkpoints to a verified Hugging Face folder."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.checkpoints import Crafted, truncate
from harness.contracts import mismatches
from harness.training import SharedRuns, final_params
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.consolidate import folder as folder_module
from stagetrain.consolidate import writer
from stagetrain.consolidate.folder import (
    DTYPES,
    MANIFEST,
    FiniteCheck,
    Manifest,
    _tied_names,
    consolidate,
    eval_loss,
)
from stagetrain.consolidate.writer import INDEX, parse_size, plan_shards
from stagetrain.errors import StageError
from stagetrain.tasks.problem import ANSWER_TOKEN, PROBLEM_TOKEN
from stagetrain.tasks.prompts import Prompter
from stagetrain.training.engine import load_model_config
from stagetrain.training.integrity import expected_files, safe_globals, weights_only_loads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(shared_runs: SharedRuns) -> SharedRuns:
    """fp32 two-rank runs whose checkpoints take each reading path: ZeRO 0, 1, 2, 3, AutoTP, and a
    Mixtral (MoE sparse blocks as ZeRO-3 leaf modules); the session's shared runs, read only.
    Each summary names its model config."""
    return shared_runs


def _consolidate(
    data: dict[str, str], summary: dict[str, Any], out: Path, on_phase: Any = None, **cfg: str
) -> Manifest:
    summary_path = out.parent / f"{out.name}-summary.json"
    summary_path.write_text(json.dumps(summary))
    return consolidate(
        stage="pretrain", summary_path=str(summary_path), tokenizer_dir=data["tokenizer"],
        model_config_path=summary.get("model_config", data["model_config"]), meta_path=data["meta"],
        out=str(out), cfg=ConsolidateSettings(**{"dtype": "fp32", "max_shard_size": "2GB", "verify": "loss", **cfg}),
        on_phase=on_phase,
    )  # fmt: skip


def _reference_shards(summary: dict[str, Any], dtype: str, max_size: str, out: Path) -> None:
    """The shards and index as consolidation wrote them before it streamed (kept here as the reference):
    DeepSpeed's own zero_to_fp32 (lazy mode) for ZeRO 1-3 under the weights-only unpickler, the model
    file's whole tensors for ZeRO 0, torch.cat of the tp slices for AutoTP; safetensors' save_file."""
    folder, tag, layout = (
        summary["checkpoint"]["folder"],
        summary["checkpoint"]["tag"],
        summary["layout"],
    )
    config = load_model_config(summary["model_config"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    names = sorted(set(shapes) - _tied_names(skeleton))
    with torch.serialization.safe_globals(safe_globals()), weights_only_loads():
        files = expected_files(Path(folder) / tag, layout)
        if layout["tp"] > 1:
            slices = [torch.load(f, weights_only=True)["module"] for f in files[: layout["tp"]]]
            weights = {}
            for name in names:
                parts = [s[name] for s in slices]
                dims = [
                    d
                    for d, (a, b) in enumerate(zip(parts[0].shape, shapes[name], strict=True))
                    if a != b
                ]
                weights[name] = torch.cat(parts, dim=dims[0]) if dims else parts[0]
        elif layout["zero_stage"] == 0:
            weights = torch.load(files[0], weights_only=True)["module"]
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            weights = get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag, lazy_mode=True)
    out.mkdir()
    sizes = {n: math.prod(shapes[n]) * DTYPES[dtype].itemsize for n in names}
    groups = plan_shards(sizes, parse_size(max_size))
    weight_map = {}
    for i, group in enumerate(groups, 1):
        filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            value = (
                weights[name]
                if isinstance(weights[name], torch.Tensor)
                else weights[name].contiguous()
            )
            tensors[name] = value.to(DTYPES[dtype]).contiguous().view(shapes[name])
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize(
    ("name", "dtype", "max_size"),
    [("zero0", "bf16", "1MB"), ("zero1", "fp32", "2GB"), ("zero2", "bf16", "300KB"), ("zero2", "fp32", "1MB"),
     ("zero3", "bf16", "1MB"), ("zero3", "fp32", "2GB"), ("tp2", "bf16", "1MB"), ("tp2", "fp32", "2GB"),
     ("moe", "bf16", "200KB"), ("moe", "fp32", "2GB")],
)  # fmt: skip
def test_streamed_shards_equal_the_reference_bytes(data: dict[str, str], runs: SharedRuns, tmp_path: Path,
                                                   name: str, dtype: str, max_size: str) -> None:  # fmt: skip
    """Every shard and the index, byte for byte, as the whole-tensor implementation wrote them; the
    folder verifies (reloaded, the logged loss reproduced: MoE included)."""
    manifest = _consolidate(
        data, runs[name], tmp_path / "model", dtype=dtype, max_shard_size=max_size
    )
    _reference_shards(runs[name], dtype, max_size, tmp_path / "reference")
    expected = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert len(expected) > 2 if max_size != "2GB" else len(expected) == 2
    for filename in expected:
        assert (tmp_path / "model" / filename).read_bytes() == (tmp_path / "reference" / filename).read_bytes(), filename  # fmt: skip
    assert manifest["verification"]["method"] == "loss"
    assert manifest["verification"]["eval_loss"] == pytest.approx(
        runs[name]["final_eval_loss"], rel=2e-2
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX).read_text())
    out = {}
    for filename in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / filename))
    return out


@pytest.mark.parametrize("name", ["zero0", "zero2", "zero3"])
def test_fp32_output_equals_deepspeeds_fp32_state_dict(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path, name: str
) -> None:
    manifest = _consolidate(data, runs[name], tmp_path / "model")
    written, reference = _weights(tmp_path / "model"), final_params(runs[name])
    assert set(written) == set(reference) - {
        "lm_head.weight"
    }  # tied to the embedding, as transformers saves it
    assert all(torch.equal(written[k], reference[k]) for k in written)
    assert manifest["verification"]["relative_tolerance"] == 1e-4
    assert manifest["vocab_size"] == 512 and manifest["step"] == 4
    assert not mismatches(json.loads((tmp_path / "model" / MANIFEST).read_text()), Manifest)


def test_finite_verification_reads_every_shard_back(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    """verify: finite writes the same folder without reloading the model, and reads each shard back from
    disk: a NaN or a cut written into a shard after the conversion is found, and nothing is left."""
    manifest = _consolidate(data, runs["zero3"], tmp_path / "model", dtype="bf16", max_shard_size="1MB", verify="finite")  # fmt: skip
    index = json.loads((tmp_path / "model" / INDEX).read_text())
    assert manifest["verification"] == {"method": "finite", "tensors": len(index["weight_map"]),
                                        "training_eval_loss": runs["zero3"]["final_eval_loss"]}  # fmt: skip
    written = json.loads((tmp_path / "model" / MANIFEST).read_text())
    # harness.contracts checks a union against its first member (LossCheck): FiniteCheck apart
    found = [m for m in mismatches(written, Manifest) if not m.startswith(".verification.")]
    assert not found + mismatches(written["verification"], FiniteCheck)
    _reference_shards(runs["zero3"], "bf16", "1MB", tmp_path / "reference")
    assert all((tmp_path / "model" / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "reference").iterdir())  # fmt: skip

    def damage(edit: Any) -> Any:
        def on_phase(phase: str) -> None:
            if phase == "convert":
                edit(sorted((tmp_path / ".model.tmp").glob("*.safetensors"))[-1])

        return on_phase

    def nan(shard: Path) -> None:
        with open(shard, "r+b") as handle:
            handle.seek(-2, 2)
            handle.write(b"\xc0\x7f")  # a bf16 NaN, little-endian

    def cut(shard: Path) -> None:
        os.truncate(shard, shard.stat().st_size - 10)

    shutil.rmtree(tmp_path / "model")
    for edit, message in ((nan, r"pretrain: \S+ reads back from model-00003-of-00003.safetensors with non-finite values; nothing was written"),
                          (cut, "pretrain: model-00003-of-00003.safetensors does not read back as safetensors")):  # fmt: skip
        with pytest.raises(StageError, match=message) as err:
            _consolidate(data, runs["zero3"], tmp_path / "model", damage(edit), dtype="bf16", max_shard_size="1MB", verify="finite")  # fmt: skip
        assert "\n" not in str(err.value) and _nothing_written(tmp_path)


def test_the_folder_loads_with_transformers_and_reproduces_the_loss(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    summary = runs["zero3"]
    _consolidate(data, summary, tmp_path / "model", dtype="bf16", max_shard_size="1MB")
    folder = tmp_path / "model"
    index = json.loads((folder / INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded at 1 MB
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 512
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (
        tokenizer.decode(tokenizer("12+34=46", add_special_tokens=False)["input_ids"]) == "12+34=46"
    )
    loss = eval_loss(model.float(), summary["eval_batch"], "uint16")
    assert loss == pytest.approx(summary["final_eval_loss"], rel=2e-2)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in folder.iterdir() if p.name != MANIFEST}
    assert {"torch", "deepspeed", "transformers"} == set(manifest["versions"])


def test_a_plain_generate_stops_where_the_pipelines_sampler_does(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    """generation_config.json ends a completion at eos and at the next problem's marker, the
    sampler's stops: transformers' own `generate`, forced to begin a new problem, stops there."""
    _consolidate(data, runs["zero0"], tmp_path / "model")
    folder = tmp_path / "model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    marker = tokenizer.convert_tokens_to_ids(PROBLEM_TOKEN)
    assert marker not in (None, tokenizer.unk_token_id)
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, marker]
    assert (
        set(model.generation_config.eos_token_id)
        == Prompter(tokenizer, chat_template=False, limit=64).stops
    )

    class NewProblemAt(LogitsProcessor):  # the model goes on to a new problem at its 3rd token
        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if ids.shape[1] == prompt_len + 2:
                scores[:, :] = -math.inf
                scores[:, marker] = 0.0
            else:
                scores[:, list(model.generation_config.eos_token_id)] = -math.inf
            return scores

    ids = tokenizer(
        f"{PROBLEM_TOKEN}12+34{ANSWER_TOKEN}", add_special_tokens=False, return_tensors="pt"
    )
    prompt_len = ids["input_ids"].shape[1]
    out = model.generate(**ids, do_sample=False, max_new_tokens=20,
                         logits_processor=LogitsProcessorList([NewProblemAt()]))  # fmt: skip
    assert out[0, prompt_len:].tolist()[-1] == marker and out.shape[1] == prompt_len + 3


def test_autotp_slices_are_gathered(data: dict[str, str], runs: SharedRuns, tmp_path: Path) -> None:
    """tp=2 files hold halves of the split layers; the folder holds whole tensors that reproduce the loss."""
    manifest = _consolidate(data, runs["tp2"], tmp_path / "model")
    written = _weights(tmp_path / "model")
    assert written["model.layers.0.self_attn.q_proj.weight"].shape == (128, 128)
    assert written["model.layers.0.self_attn.o_proj.weight"].shape == (128, 128)
    assert written["model.layers.0.mlp.down_proj.weight"].shape == (128, 512)
    assert manifest["verification"]["eval_loss"] == pytest.approx(
        runs["tp2"]["final_eval_loss"], rel=1e-4
    )


def test_consolidating_twice_gives_identical_bytes(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    _consolidate(data, runs["zero2"], tmp_path / "a", dtype="bf16")
    _consolidate(data, runs["zero2"], tmp_path / "b", dtype="bf16")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert all(
        (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names
    )


def _broken_copy(summary: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    folder = tmp_path / "ckpt"
    shutil.copytree(summary["checkpoint"]["folder"], folder)
    return {
        **summary,
        "checkpoint": {**summary["checkpoint"], "folder": str(folder)},
    }, folder / summary["checkpoint"]["tag"]


def _nothing_written(tmp_path: Path) -> bool:
    return not (tmp_path / "model").exists() and not (tmp_path / ".model.tmp").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("pointer", "latest.json: missing: no complete checkpoint"),
        (
            "pointer shape",
            "latest.json: expected an object with tag, step and layout, found a JSON list",
        ),
        ("tag folder", "step00000004: missing: the folder of checkpoint step00000004 is gone"),
        (
            "optimizer",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt: unreadable, truncated or corrupt",
        ),
        ("rank file", "zero_pp_rank_1_mp_rank_00_model_states.pt: missing from the checkpoint"),
        (
            "truncated",
            "zero_pp_rank_0_mp_rank_00_model_states.pt: unreadable, truncated or corrupt",
        ),
    ],
)
def test_a_broken_checkpoint_is_one_line_and_writes_nothing(data: dict[str, str], runs: SharedRuns, tmp_path: Path,
                                                            damage: str, message: str) -> None:  # fmt: skip
    summary, tag_dir = _broken_copy(runs["zero3"], tmp_path)
    if damage == "pointer":
        (tag_dir.parent / "latest.json").unlink()
    elif damage == "pointer shape":
        (tag_dir.parent / "latest.json").write_text("[]")
    elif damage == "tag folder":
        shutil.rmtree(tag_dir)
    elif damage == "optimizer":
        truncate(tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif damage == "rank file":
        (tag_dir / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    else:
        truncate(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(StageError, match=message) as err:
        _consolidate(data, summary, tmp_path / "model")
    assert "\n" not in str(err.value) and _nothing_written(tmp_path)


def test_a_loss_that_does_not_match_fails_and_writes_nothing(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    summary = {**runs["zero0"], "final_eval_loss": runs["zero0"]["final_eval_loss"] * 1.1}
    with pytest.raises(StageError, match="validation loss .* differs from .* nothing was written"):
        _consolidate(data, summary, tmp_path / "model")
    assert not (tmp_path / "model").exists() and not (tmp_path / ".model.tmp").exists()


class _FullDisk:
    """A shard file on a disk that fills after `room` bytes: what fits is written, then ENOSPC."""

    def __init__(self, path: Path, mode: str, room: int = 4096) -> None:
        self.path, self.handle, self.room = path, open(path, mode), room  # noqa: SIM115

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.handle.write(view[: self.room])
        if len(view) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        self.room -= len(view)
        return len(view)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_nothing(
    data: dict[str, str],
    runs: SharedRuns,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """ENOSPC in the middle of a shard, or at the atomic writer of MANIFEST.json (the last file)."""
    if where == "shard":
        monkeypatch.setattr(writer, "open", _FullDisk, raising=False)
        name = "model-00001-of-00001.safetensors"
    else:

        def full(path: Path, obj: Any) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(folder_module, "atomic_write_json", full)
        name = MANIFEST
    with pytest.raises(StageError) as err:
        _consolidate(data, runs["zero0"], tmp_path / "model")
    assert str(err.value) == (
        f"{tmp_path / 'model'}: could not write the consolidated folder ({name}): No space left "
        "on device; nothing was written (free space there and rerun consolidate)"
    )
    assert _nothing_written(tmp_path)


def _edit_zero0_weights(
    summary: dict[str, Any], tmp_path: Path, name: str, edit: Any
) -> dict[str, Any]:
    """A copy of the ZeRO-0 checkpoint with `edit(tensor)` applied to weight `name` in its model file."""
    summary, tag_dir = _broken_copy(summary, tmp_path)
    path = tag_dir / "mp_rank_00_model_states.pt"
    with torch.serialization.safe_globals(safe_globals()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    edit(state["module"][name])
    torch.save(state, path)
    return summary


def test_random_bytes_in_a_weight_fail_naming_it_and_write_nothing(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    """20 KB of random bytes in one tensor, its size kept: non-finite weights are refused."""
    noise = torch.randint(
        0, 256, (20_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    name = "model.layers.1.mlp.down_proj.weight"
    summary = _edit_zero0_weights(runs["zero0"], tmp_path, name, lambda t: t.view(-1).view(torch.uint8)[:20_000].copy_(noise))  # fmt: skip
    with pytest.raises(StageError, match=f"step00000004: {name} holds non-finite values .* nothing was written") as err:  # fmt: skip
        _consolidate(data, summary, tmp_path / "model")
    assert "\n" not in str(err.value) and _nothing_written(tmp_path)


def test_a_non_finite_validation_loss_fails_and_writes_nothing(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    """Finite weights that overflow in the forward pass give a NaN loss, which no tolerance catches."""
    summary = _edit_zero0_weights(
        runs["zero0"], tmp_path, "model.norm.weight", lambda t: t.fill_(3e38)
    )
    with pytest.raises(StageError, match="validation loss is nan .* nothing was written") as err:
        _consolidate(data, summary, tmp_path / "model")
    assert "\n" not in str(err.value) and _nothing_written(tmp_path)
    diverged = {**runs["zero0"], "final_eval_loss": float("nan")}
    with pytest.raises(StageError, match="the training logged a validation loss of nan at step 4"):
        _consolidate(data, diverged, tmp_path / "model")
    assert _nothing_written(tmp_path)


def test_a_crafted_rank_file_is_refused_and_its_code_never_runs(
    data: dict[str, str], runs: SharedRuns, tmp_path: Path
) -> None:
    summary, tag_dir = _broken_copy(runs["zero3"], tmp_path)
    marker = tmp_path / "MARKER"
    torch.save({"optimizer_state_dict": Crafted(marker)}, tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")  # fmt: skip
    with pytest.raises(StageError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: refused: .*GLOBAL io.open") as err:  # fmt: skip
        _consolidate(data, summary, tmp_path / "model")
    assert "\n" not in str(err.value) and _nothing_written(tmp_path)
    assert not marker.exists()


def test_shard_planning() -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("500KB") == 500_000
    assert plan_shards({"a": 6, "b": 5, "c": 5, "d": 20}, 10) == [["a"], ["b", "c"], ["d"]]
