"""The streaming pieces of consolidation, without DeepSpeed runs: the shard writer's bytes, the reader's
regions and chunks, and the ZeRO layouts on hand-made partition files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from harness.checkpoints import saved
from safetensors.torch import load_file, save_file

from stagetrain.consolidate.folder import finite_as, kept_in_fp32, output_dtypes
from stagetrain.consolidate.stored import Reader, Region, Stored, describe, region_of, span
from stagetrain.consolidate.weights import (
    FP32_GROUPS,
    checkpoint_files,
    expert_parallel_weights,
    gather_tp,
    read_weights,
    zero3_layout,
    zero12_layout,
)
from stagetrain.consolidate.writer import INDEX, plan_shards, write_shards
from stagetrain.errors import StageError
from stagetrain.planning.plan import verifies_on_gpu
from stagetrain.training.checkpoints import tag_of


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed.weight": (37, 8), "model.layers.0.w": (5, 3, 2), "model.norm": (8,),
              "b": (1,), "a.scalar": (), "z": (1000,)}  # fmt: skip
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_streamed_shards_are_the_bytes_of_save_file(
    tmp_path: Path, dtype: torch.dtype, piece: int
) -> None:
    """Any chunking gives the bytes safetensors' own save_file writes for the same shard."""
    tensors = _tensors(dtype)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}

    def chunks(name: str):
        flat = tensors[name].reshape(-1)
        for i in range(0, flat.numel(), piece):
            yield flat[i : i + piece]

    max_bytes = 300 * dtype.itemsize
    index = write_shards(sorted(tensors), shapes, dtype, chunks, tmp_path, max_bytes)
    groups = plan_shards({n: t.numel() * dtype.itemsize for n, t in tensors.items()}, max_bytes)
    assert len(groups) == 3 and json.loads((tmp_path / INDEX).read_text()) == index
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(tmp_path / "ref"), metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref").read_bytes()
        assert all(torch.equal(v, tensors[k]) for k, v in load_file(tmp_path / name).items())


def test_shards_mixing_fp32_into_bf16_are_the_bytes_of_save_file(tmp_path: Path) -> None:
    """What transformers keeps in fp32 in a bf16 folder (DeepseekV3's routing bias and router
    weights, named by `_keep_in_fp32_modules_strict` and matched as transformers matches them)
    is written in fp32, fp32 tensors first in their shard, as save_file orders them."""
    tensors = _tensors(torch.float32)
    names = sorted(tensors)
    dtypes = output_dtypes(names, torch.bfloat16, ["model.norm", "scalar"])
    assert {n for n, d in dtypes.items() if d == torch.float32} == {"model.norm", "a.scalar"}
    assert kept_in_fp32(names, ["b"]) == {"model.embed.weight", "b"}  # anywhere in a name
    assert output_dtypes(names, torch.float32, ["b"]) == dict.fromkeys(names, torch.float32)
    assert kept_in_fp32(["model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.gate.weight",
                         "model.layers.3.mlp.up_proj.weight"], ["e_score_correction_bias", "gate.weight"]) == {
        "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.gate.weight"}  # fmt: skip
    wanted = {n: t.to(dtypes[n]) for n, t in tensors.items()}
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    index = write_shards(
        names, shapes, dtypes, lambda n: iter([wanted[n].reshape(-1)]), tmp_path, 600
    )
    sizes = {n: t.numel() * t.element_size() for n, t in wanted.items()}
    groups = plan_shards(sizes, 600)
    assert len(groups) == 3 and index["metadata"]["total_size"] == sum(sizes.values())
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: wanted[n] for n in group}, str(tmp_path / "ref"), metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref").read_bytes(), group
        assert all(torch.equal(v, wanted[k]) for k, v in load_file(tmp_path / name).items())


def test_a_tensor_short_of_its_bytes_is_a_bug_not_a_shard(tmp_path: Path) -> None:
    def short(name: str):
        yield torch.zeros(3)

    with pytest.raises(RuntimeError, match="a: 12 bytes written, 16 expected"):
        write_shards(["a"], {"a": (4,)}, torch.float32, short, tmp_path, 10**6)


def _saved(tmp_path: Path, obj: object, name: str = "f.pt") -> tuple[Path, object]:
    path = tmp_path / name
    torch.save(obj, path)
    return path, describe(path)


def test_regions_read_exactly_the_tensors_bytes_in_small_chunks(tmp_path: Path) -> None:
    """Views into a shared storage (as DeepSpeed's flat groups are) are read at their offsets;
    a chunk never exceeds the buffer, and the reader reads only the regions asked for."""
    flat = torch.arange(1000, dtype=torch.float32)
    obj = {"a": flat[10:110].view(10, 10), "b": flat[500:], "moment": torch.full((5000,), 7.0)}
    path, meta = _saved(tmp_path, obj)
    regions = {k: region_of(path, meta[k], k) for k in ("a", "b")}
    before = _rchar()
    own = _rchar() - before  # reading /proc/self/io counts too
    before += own
    with Reader(chunk_bytes=64) as reader:
        for key, region in regions.items():
            stored = Stored(tuple(obj[key].shape), (region,))
            chunks = [c.clone() for c in reader.chunks(stored)]
            assert max(c.numel() for c in chunks) == 16
            assert torch.equal(torch.cat(chunks), obj[key].reshape(-1))
    read = _rchar() - before - own
    assert read == (100 + 500) * 4  # the two regions' bytes, not the 20 KB moment


def _rchar() -> int:
    """Bytes this process has asked the kernel to read (/proc/self/io)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def test_autotp_slices_are_interleaved_along_their_split_dimension(tmp_path: Path) -> None:
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    halves = full.chunk(2, dim=1)
    paths = [_saved(tmp_path, {"w": h.contiguous()}, f"{i}.pt") for i, h in enumerate(halves)]
    pieces = tuple(region_of(p, m["w"], "w") for p, m in paths)
    with Reader(chunk_bytes=20) as reader:
        got = torch.cat([c.clone() for c in reader.chunks(Stored((6, 8), pieces, split_dim=1))])
    assert torch.equal(got.view(6, 8), full)


def test_a_region_past_the_end_of_its_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"\0" * 100)
    stored = Stored((50,), (Region(tmp_path / "f", 0, torch.float32, 50),))
    with Reader() as reader, pytest.raises(StageError, match="f: truncated: .* 200 bytes at offset 0, but the file ends at 100"):  # fmt: skip
        list(reader.chunks(stored))


def _read(stored: Stored) -> torch.Tensor:
    with Reader(chunk_bytes=32) as reader:
        return torch.cat([c.clone() for c in reader.chunks(stored)]).view(stored.shape)


def test_zero12_layout_cuts_the_groups_vector_at_ranks_and_paddings(tmp_path: Path) -> None:
    """Two parameters (3x5, 7) with 1 element of alignment padding after the first, split over
    3 ranks whose last share lacks its padding (as DeepSpeed saves it)."""
    params = [torch.randn(3, 5), torch.randn(7)]
    vector = torch.cat([params[0].reshape(-1), torch.zeros(1), params[1]])  # 23 elements
    shares = [vector[0:8], vector[8:16], vector[16:23]]
    regions = []
    for r, share in enumerate(shares):
        path, meta = _saved(tmp_path, {"g": [share.clone()]}, f"r{r}.pt")
        regions.append([region_of(path, meta["g"][0], "g")])
    shapes = [{"p0": (3, 5), "p1": (7,)}]
    weights = zero12_layout(shapes, regions, [[1, 0]], "ckpt")
    assert torch.equal(_read(weights["p0"]), params[0]) and torch.equal(
        _read(weights["p1"]), params[1]
    )
    with pytest.raises(StageError, match="ckpt: group 0's parameters take 16 elements, its fp32 partitions hold 23"):  # fmt: skip
        zero12_layout([{"p0": (3, 5)}], regions, [[1]], "ckpt")


def test_zero3_layout_joins_each_parameters_rank_slices(tmp_path: Path) -> None:
    """ZeRO-3 over 2 ranks: each rank's flat groups hold ceil(n/2) elements of every parameter,
    the last slice zero-padded; here the rank's flat is split into two groups mid-parameter."""
    params = {"a": torch.randn(3, 3), "b": torch.randn(4)}
    ranks = [[], []]
    for p in params.values():
        flat = torch.cat([p.reshape(-1), torch.zeros(math.ceil(p.numel() / 2) * 2 - p.numel())])
        for r, half in enumerate(flat.chunk(2)):
            ranks[r].append(half)
    partitions = []
    for r, parts in enumerate(ranks):
        whole = torch.cat(parts)  # 5 + 2 elements
        path, meta = _saved(tmp_path, {"g": [whole[:3].clone(), whole[3:].clone()]}, f"r{r}.pt")
        partitions.append([region_of(path, t, "g") for t in meta["g"]])
    weights = zero3_layout([{"a": (3, 3)}, {"b": (4,)}], partitions, "ckpt")
    assert all(torch.equal(_read(weights[n]), p) for n, p in params.items())
    with pytest.raises(StageError, match="ckpt: the parameters take 6 elements of each rank's fp32 partition, which holds 7"):  # fmt: skip
        zero3_layout([{"a": (3, 3)}, {"b": (2,)}], partitions, "ckpt")


def test_span_names_a_short_partition() -> None:
    pieces = [Region(Path("x"), 0, torch.float32, 4), Region(Path("y"), 8, torch.float32, 4)]
    assert span(pieces, 3, 3, "w") == (Region(Path("x"), 12, torch.float32, 1), Region(Path("y"), 8, torch.float32, 2))  # fmt: skip
    with pytest.raises(StageError, match="w: the fp32 partitions end 1 elements before"):
        span(pieces, 6, 3, "w")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finite_as_agrees_with_isfinite_after_conversion(dtype: torch.dtype) -> None:
    """The extremes decide: fp32 values beyond bf16's range round to inf, a NaN anywhere is caught."""
    big = torch.finfo(torch.bfloat16).max
    edges = [0.0, 1e30, big, 3.3961e38, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan")]
    for edge in edges:
        for where in (0, 500, 999):
            chunk = torch.randn(1000)
            chunk[where] = edge
            assert finite_as(chunk, dtype) == bool(torch.isfinite(chunk.to(dtype)).all()), (
                edge,
                where,
            )
    assert finite_as(torch.arange(10), dtype)


def test_the_loss_is_verified_on_the_gpu_only_where_the_model_fits_in_it() -> None:
    """No GPU: the CPU. A GPU with room for the model and its logits and a fifth more: the GPU.
    Less room: the CPU, where a model larger than one GPU still fits in host memory."""
    gib = 2**30
    assert not verifies_on_gpu(10 * gib, None)
    assert verifies_on_gpu(10 * gib, 12 * gib)
    assert not verifies_on_gpu(10 * gib, 11 * gib)


def _checkpoint(root: Path, layout: dict[str, int], files: dict[str, object]) -> Path:
    """A checkpoint folder at step 2 under `layout`, saved through the real Checkpoints (so its
    pointer names the tag), whose files then get `files`' contents (by file name)."""
    ckpt = saved(root, [2], layout)
    base = ckpt.folder / tag_of(2)
    for name, content in files.items():
        assert (base / name).exists(), name  # only DeepSpeed's own file names
        torch.save(content, base / name)
    return ckpt.folder


def _zero_model(shapes: list[dict[str, tuple[int, ...]]], **extra: object) -> dict[str, object]:
    """A ZeRO model-states file: the parameter shapes, the buffer `buf` and `tied` sharing `a`."""
    return {
        "module": {"buf": torch.arange(3.0), "not_a_buffer": torch.ones(2)},
        "param_shapes": [{n: torch.Size(s) for n, s in group.items()} for group in shapes],
        "buffer_names": ["buf", "absent_buffer"],
        "shared_params": {"tied": "a", "tied_to_nothing": "absent"},
        **extra,
    }


def _optim(key: str, groups: list[torch.Tensor], **extra: object) -> dict[str, object]:
    return {"optimizer_state_dict": {key: [g.clone() for g in groups], **extra}}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero12_checkpoint_reads_every_ranks_share_with_buffers_and_ties(
    tmp_path: Path, stage: int
) -> None:
    """dp=2: the group's vector (a 2x3, b 3) is the two ranks' shares in rank order; the
    buffer listed comes from rank 0's model file and a shared name takes its parameter's
    regions; names DeepSpeed lists but the file lacks are left out."""
    a, b = torch.randn(2, 3), torch.randn(3)
    vector = torch.cat([a.reshape(-1), b, torch.zeros(3)])  # padded to 12 = a multiple of 2 * dp
    key = "single_partition_of_fp32_groups"
    layout = {"dp": 2, "tp": 1, "zero_stage": stage}
    folder = _checkpoint(tmp_path, layout, {
        "mp_rank_00_model_states.pt": _zero_model([{"a": (2, 3), "b": (3,)}]),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": _optim(key, [vector[:6]], param_alignment_paddings=[[0, 3]]),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": _optim(key, [vector[6:]], param_alignment_paddings=[[0, 3]]),
    })  # fmt: skip
    weights = read_weights(folder, tag_of(2), layout, {})
    assert sorted(weights) == ["a", "b", "buf", "tied"]
    assert torch.equal(_read(weights["a"]), a) and torch.equal(_read(weights["b"]), b)
    assert torch.equal(_read(weights["buf"]), torch.arange(3.0))
    assert weights["tied"] == weights["a"]


def test_a_zero3_checkpoint_joins_each_ranks_slice_from_the_optimizer_files(tmp_path: Path) -> None:
    """dp=2 ZeRO-3: the weights come from the dp optimizer files (not the model files, which
    are one per rank here), each rank holding ceil(n/2) elements of every parameter."""
    a, b = torch.randn(2, 3), torch.randn(3)  # 6 -> 3 + 3, 3 -> 2 + 1 and a zero
    ranks = [
        torch.cat([a.reshape(-1)[:3], b[:2]]),
        torch.cat([a.reshape(-1)[3:], b[2:], torch.zeros(1)]),
    ]
    key = "fp32_flat_groups"
    layout = {"dp": 2, "tp": 1, "zero_stage": 3}
    model = _zero_model([{"a": (2, 3), "b": (3,)}])
    folder = _checkpoint(tmp_path, layout, {
        "zero_pp_rank_0_mp_rank_00_model_states.pt": model,
        "zero_pp_rank_1_mp_rank_00_model_states.pt": model,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": _optim(key, [ranks[0]]),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": _optim(key, [ranks[1]]),
    })  # fmt: skip
    weights = read_weights(folder, tag_of(2), {**layout, "ep": 1}, {})
    assert sorted(weights) == ["a", "b", "buf", "tied"]
    assert torch.equal(_read(weights["a"]), a) and torch.equal(_read(weights["b"]), b)


def test_a_zero0_checkpoint_is_the_model_files_whole_tensors(tmp_path: Path) -> None:
    w = torch.randn(4, 2)
    layout = {"dp": 1, "tp": 1, "zero_stage": 0}
    folder = _checkpoint(tmp_path, layout, {"mp_rank_00_model_states.pt": {"module": {"w": w}}})
    weights = read_weights(folder, tag_of(2), layout, {"w": (4, 2)})
    assert list(weights) == ["w"] and torch.equal(_read(weights["w"]), w)


def test_autotp_model_files_are_gathered_along_the_one_dimension_tp_splits(tmp_path: Path) -> None:
    """tp=2 (ZeRO-1, so optimizer files lie beside the tp model files and are not read): a
    tensor sliced in half along dim 1 is put back side by side, a replicated one (already of
    the full shape) is rank 0's, and a name of the config no shard holds is left out."""
    w, norm = torch.randn(3, 4), torch.randn(3)
    halves = [h.contiguous() for h in w.chunk(2, dim=1)]
    layout = {"dp": 1, "tp": 2, "zero_stage": 1}
    folder = _checkpoint(tmp_path, layout, {
        "mp_rank_00_model_states.pt": {"module": {"w": halves[0], "norm": norm}},
        "mp_rank_01_model_states.pt": {"module": {"w": halves[1], "norm": torch.zeros(3)}},
    })  # fmt: skip
    shapes = {"gone": (2,), "norm": (3,), "w": (3, 4)}  # each kind is followed by another
    weights = read_weights(folder, tag_of(2), layout, shapes)
    assert sorted(weights) == ["norm", "w"]
    assert weights["w"].split_dim == 1 and torch.equal(_read(weights["w"]), w)
    assert weights["norm"].split_dim == 0 and torch.equal(_read(weights["norm"]), norm)


@pytest.mark.parametrize(
    ("slice_shape", "expected"),
    [((2, 2), (4, 4)), ((3, 2), (3, 5)), ((3, 2), (3, 4, 1)), ((3, 2, 1), (3, 4))],
    ids=["two-dims", "none", "fewer-dims", "more-dims"],
)
def test_tp_slices_that_make_the_shape_along_no_single_dimension_are_one_line(
    tmp_path: Path, slice_shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    shards = [{"w": Stored(slice_shape, (Region(tmp_path / f"{r}", 0, torch.float32, 4),))} for r in range(2)]  # fmt: skip
    message = f"w: tp slices of shape {slice_shape} do not make {expected} with tp=2"
    with pytest.raises(StageError, match=f"^{re.escape(message)}$"):
        gather_tp(shards, {"w": expected})


@pytest.mark.parametrize(
    ("model", "optim", "message"),
    [
        ({"module": {}, "param_shapes": [], "buffer_names": []}, None, r"model_states.pt: not a ZeRO model-states file \(no 'shared_params'\)$"),
        ({"module": {}}, None, r"model_states.pt: not a ZeRO model-states file \(no 'param_shapes'\)$"),
        (_zero_model([{"a": (2,)}], frozen_param_shapes={"f": torch.Size([2]), "g": torch.Size([1])}), None,
         r"model_states.pt: 2 frozen parameters \(e.g. f\); consolidation reads only trained ones$"),
        (_zero_model([{"a": (2,)}]), {"optimizer_state_dict": {"fp32_flat_groups": []}},
         r"zero_pp_rank_0_mp_rank_00_optim_states.pt: not a ZeRO-2 optimizer file \(no 'single_partition_of_fp32_groups'\)$"),
        (_zero_model([{"a": (2,), "b": (2,)}]), _optim("single_partition_of_fp32_groups", [torch.zeros(4)], param_alignment_paddings=[[0]]),
         r"step00000002: ZeRO-2 over 2 ranks: group 0 has 2 parameters but 1 alignment paddings$"),
    ],
    ids=["no-shared-params", "no-param-shapes", "frozen", "stage-3-optimizer", "paddings"],
)  # fmt: skip
def test_a_checkpoint_consolidation_cannot_read_is_one_line_naming_the_file(
    tmp_path: Path, model: dict, optim: dict | None, message: str
) -> None:
    optim = optim or _optim("single_partition_of_fp32_groups", [torch.zeros(4)])
    layout = {"dp": 2, "tp": 1, "zero_stage": 2}
    folder = _checkpoint(tmp_path, layout, {
        "mp_rank_00_model_states.pt": model,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": optim,
    })  # fmt: skip
    with pytest.raises(StageError, match=message):
        read_weights(folder, tag_of(2), layout, {})


def test_an_expert_parallel_checkpoint_is_read_from_its_universal_copy_without_ep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ep=2: the tag is converted to a layout equal but for ep=1, each zero/<name>/fp32.pt's
    `param` is a weight under its folder's name, and buffers and ties come from the copy's
    model file (not the tag's own)."""
    layout = {"dp": 2, "tp": 1, "zero_stage": 2, "ep": 2}
    folder = tmp_path / "ckpt"
    calls = []
    copy = folder / "step00000002_universal"
    params = {"a": torch.randn(2, 2), "b": torch.randn(3)}
    for name, tensor in params.items():
        (copy / "zero" / name).mkdir(parents=True)
        torch.save({"param": tensor, "cat_dim": 0}, copy / "zero" / name / "fp32.pt")
    (copy / "zero" / "stray.txt").write_text("not a parameter folder")
    model = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}}, model)
    torch.save(_zero_model([]), copy / model.name)

    def convert(*args: object) -> str:
        calls.append(args)
        return copy.name

    monkeypatch.setattr("stagetrain.training.reshard.convert", convert)
    weights = expert_parallel_weights(folder, "step00000002", layout, model)
    assert calls == [(folder, "step00000002", layout, {**layout, "ep": 1})]
    assert sorted(weights) == ["a", "b", "buf", "tied"]
    assert all(torch.equal(_read(weights[n]), t) for n, t in params.items())
    assert torch.equal(_read(weights["buf"]), torch.arange(3.0)) and weights["tied"] == weights["a"]
    torch.save({"cat_dim": 0}, copy / "zero" / "b" / "fp32.pt")
    with pytest.raises(StageError, match=r"zero/b/fp32.pt: a universal checkpoint's parameter file without 'param'$"):  # fmt: skip
        expert_parallel_weights(folder, "step00000002", layout, model)


def test_consolidation_reads_only_the_checkpoint_the_pointer_and_the_summary_agree_on(
    tmp_path: Path,
) -> None:
    layout = {"dp": 2, "tp": 1, "zero_stage": 2}
    folder = saved(tmp_path, [2, 4], layout).folder
    with pytest.raises(StageError, match=r"latest.json: points at step00000004, but the summary names step00000002$"):  # fmt: skip
        checkpoint_files(folder, tag_of(2), layout)
    (folder / "latest.json").unlink()
    with pytest.raises(StageError, match=r"latest.json: missing: no complete checkpoint was recorded for this run$"):  # fmt: skip
        checkpoint_files(folder, tag_of(4), layout)


@pytest.mark.parametrize(
    ("shapes", "total"),
    [({"a": (2, 3), "b": (2,)}, 8), ({"a": (5,)}, 8), ({"a": (3,)}, 4)],
    ids=["exact", "padded-within-a-block", "padded-to-a-block-of-4"],
)
def test_zero12_without_listed_paddings_reads_parameters_back_to_back(
    tmp_path: Path, shapes: dict[str, tuple[int, ...]], total: int
) -> None:
    """Files without param_alignment_paddings (older DeepSpeed): no padding between parameters,
    and the group padded at its end to a multiple of 2 * dp (here dp=2: 4) is accepted."""
    params = {n: torch.randn(s) for n, s in shapes.items()}
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    vector = torch.cat([flat, torch.zeros(total - flat.numel())])
    regions = []
    for r, share in enumerate(vector.chunk(2)):
        path, meta = _saved(tmp_path, {"g": [share.clone()]}, f"r{r}.pt")
        regions.append([region_of(path, meta["g"][0], "g")])
    weights = zero12_layout([shapes], regions, None, "ckpt")
    assert all(torch.equal(_read(weights[n]), p) for n, p in params.items())


def test_a_single_rank_zero2_checkpoint_reads_its_one_optimizer_file(tmp_path: Path) -> None:
    a, b = torch.randn(2, 3), torch.randn(3)
    layout = {"dp": 1, "tp": 1, "zero_stage": 2}
    key = "single_partition_of_fp32_groups"
    folder = _checkpoint(tmp_path, layout, {
        "mp_rank_00_model_states.pt": _zero_model([{"a": (2, 3), "b": (3,)}]),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": _optim(key, [torch.cat([a.reshape(-1), b, torch.zeros(1)])]),
    })  # fmt: skip
    weights = read_weights(folder, tag_of(2), layout, {})
    assert torch.equal(_read(weights["a"]), a) and torch.equal(_read(weights["b"]), b)


@pytest.mark.parametrize(
    ("stage", "numel", "message"),
    [
        (2, 4, r"step00000002: ZeRO-2 over 2 ranks: the fp32 partitions end 1 elements before a parameter does$"),
        (3, 3, r"step00000002: ZeRO-3 over 2 ranks: the fp32 partitions end 2 elements before a parameter does$"),
        (3, 8, r"step00000002: ZeRO-3 over 2 ranks: the parameters take 5 elements of each rank's fp32 partition, which holds 8; the model states do not match the optimizer files$"),
    ],
    ids=["zero2-short", "zero3-short", "zero3-long"],
)  # fmt: skip
def test_optimizer_files_that_do_not_hold_the_models_parameters_are_one_line_naming_the_tag(
    tmp_path: Path, stage: int, numel: int, message: str
) -> None:
    """a 2x3 and b 3 over 2 ranks, each rank's flat group `numel` elements."""
    layout = {"dp": 2, "tp": 1, "zero_stage": stage}
    key = FP32_GROUPS[stage]
    model = _zero_model([{"a": (2, 3), "b": (3,)}])
    models = ["mp_rank_00_model_states.pt"] if stage < 3 else [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)
    ]  # fmt: skip
    folder = _checkpoint(tmp_path, layout, {
        **dict.fromkeys(models, model),
        **{f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": _optim(key, [torch.zeros(numel)]) for r in range(2)},
    })  # fmt: skip
    with pytest.raises(StageError, match=message):
        read_weights(folder, tag_of(2), layout, {})


@pytest.mark.parametrize("where", ["module", "buffer", "optimizer"])
def test_a_strided_tensor_is_one_line_naming_it(tmp_path: Path, where: str) -> None:
    """Only contiguous tensors are read; the refusal names the file and the tensor."""
    strided = torch.randn(3, 2).t()
    if where == "module":
        layout = {"dp": 1, "tp": 1, "zero_stage": 0}
        files = {"mp_rank_00_model_states.pt": {"module": {"w": strided}}}
        named = r"mp_rank_00_model_states.pt: w is stored strided"
    else:
        layout = {"dp": 1, "tp": 1, "zero_stage": 2}
        model = _zero_model([{"a": (4,)}])
        group = torch.zeros(4)
        if where == "buffer":
            model["module"]["buf"] = strided
        else:
            group = torch.zeros(2, 2).t()
        files = {
            "mp_rank_00_model_states.pt": model,
            "zero_pp_rank_0_mp_rank_00_optim_states.pt": _optim("single_partition_of_fp32_groups", [group]),
        }  # fmt: skip
        named = {
            "buffer": r"mp_rank_00_model_states.pt: buf is stored strided",
            "optimizer": r"optim_states.pt: single_partition_of_fp32_groups\[0\] is stored strided",
        }[where]
    folder = _checkpoint(tmp_path, layout, files)
    with pytest.raises(StageError, match=named):
        read_weights(folder, tag_of(2), layout, {"w": (2, 3)})


def _universal_copy(folder: Path, model_name: str, params: dict[str, object], model: dict) -> Path:
    """A universal copy as reshard.convert leaves it: zero/<name>/fp32.pt per parameter and the
    model states under the tag's own file name."""
    copy = folder / "step00000002_universal"
    for name, content in params.items():
        (copy / "zero" / name).mkdir(parents=True)
        torch.save(content, copy / "zero" / name / "fp32.pt")
    torch.save(model, copy / model_name)
    return copy


def test_an_expert_parallel_layout_is_read_through_its_universal_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ep=2 under ZeRO-3 (so no per-expert files): read_weights converts the pointer's tag and
    reads the copy, whose model states name neither buffers nor ties here."""
    layout = {"dp": 2, "tp": 1, "zero_stage": 3, "ep": 2}
    folder = saved(tmp_path, [2], layout).folder
    a = torch.randn(2, 2)
    model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    copy = _universal_copy(folder, model_name, {"a": {"param": a}}, {"module": {}})
    calls = []

    def convert(*args: object) -> str:
        calls.append(args)
        return copy.name

    monkeypatch.setattr("stagetrain.training.reshard.convert", convert)
    weights = read_weights(folder, tag_of(2), layout, {})
    assert calls == [(folder, tag_of(2), layout, {**layout, "ep": 1})]
    assert list(weights) == ["a"] and torch.equal(_read(weights["a"]), a)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([torch.zeros(2)], r"zero/a/fp32.pt: a universal checkpoint's parameter file without 'param'$"),
        ({"param": torch.zeros(3, 2).t()}, r"zero/a/fp32.pt: a is stored strided"),
    ],
    ids=["a-list", "strided"],
)  # fmt: skip
def test_a_universal_parameter_file_that_cannot_be_read_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: object, message: str
) -> None:
    folder = tmp_path / "ckpt"
    model = tmp_path / "mp_rank_00_model_states.pt"
    copy = _universal_copy(folder, model.name, {"a": content}, {"module": {}})
    monkeypatch.setattr("stagetrain.training.reshard.convert", lambda *_: copy.name)
    with pytest.raises(StageError, match=message):
        expert_parallel_weights(
            folder, tag_of(2), {"dp": 2, "tp": 1, "zero_stage": 2, "ep": 2}, model
        )
