"""The streaming pieces of consolidation, without DeepSpeed runs: the shard writer's bytes, the reader's
regions and chunks, and the ZeRO layouts on hand-made partition files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagetrain.consolidate.folder import finite_as, kept_in_fp32, output_dtypes
from stagetrain.consolidate.stored import Reader, Region, Stored, describe, region_of, span
from stagetrain.consolidate.weights import zero3_layout, zero12_layout
from stagetrain.consolidate.writer import INDEX, plan_shards, write_shards
from stagetrain.errors import StageError
from stagetrain.planning.plan import verifies_on_gpu


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
