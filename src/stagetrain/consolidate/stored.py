"""Where a tensor's bytes lie in checkpoint files, and reading only those bytes, a bounded chunk at a time.

torch saves a checkpoint as a zip archive with one uncompressed record per
storage. Loaded by the weights-only unpickler onto the meta device, a file gives
its whole structure (every tensor's dtype, shape, stride and storage offset, and
each storage's byte offset in the file, `_checkpoint_offset`) without reading
any tensor data. A `Region` names such a run of bytes; a `Stored` tensor is the
regions that make it up in row-major order; a `Reader` reads them with
`os.pread` into one reusable buffer, so the fp32 partitions are read and the
Adam moments beside them in the same files are not.

Why not `torch.load(mmap=True)` and slicing the mapped tensors: the pages a
process touches through a file mapping stay in its resident set until it is
unmapped, so reading a checkpoint's partitions that way would grow the peak
RSS to their whole size. Through pread the bytes pass through the page cache
(not counted against the process) and one chunk-sized buffer.
"""

from __future__ import annotations

import math
import os
import pickle
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from stagetrain.errors import StageError
from stagetrain.training.integrity import safe_globals

CHUNK_BYTES = 4 * 2**20
"""Bytes read at once: large enough for copy-like throughput, small next to a shard."""


@dataclass(frozen=True, slots=True)
class Region:
    """`numel` elements of `dtype` stored contiguously at byte `offset` of `path`."""

    path: Path
    offset: int
    dtype: torch.dtype
    numel: int

    def part(self, start: int, count: int) -> Region:
        """Elements [start, start + count) of this region."""
        return Region(self.path, self.offset + start * self.dtype.itemsize, self.dtype, count)


@dataclass(frozen=True, slots=True)
class Stored:
    """A tensor of `shape` as checkpoint regions of one dtype.

    With `split_dim` 0 the regions, concatenated, are the tensor in row-major
    order. With `split_dim` d > 0 each region is one AutoTP slice (the tensor
    cut along dimension d), and the tensor is the slices side by side: each row
    of the dimensions before d takes its part of every slice in turn.
    """

    shape: tuple[int, ...]
    pieces: tuple[Region, ...]
    split_dim: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype

    def regions(self) -> Iterator[Region]:
        """The regions in the order of the tensor's elements (lazily: AutoTP rows can be many)."""
        if self.split_dim == 0:
            yield from self.pieces
            return
        rows = math.prod(self.shape[: self.split_dim])
        widths = [piece.numel // rows for piece in self.pieces]
        for row in range(rows):
            for piece, width in zip(self.pieces, widths, strict=True):
                yield piece.part(row * width, width)


def span(pieces: Iterable[Region], start: int, count: int, where: str) -> tuple[Region, ...]:
    """Elements [start, start + count) of the pieces concatenated (a parameter's place in a
    flat partition, or a parameter without the padding after its last slice)."""
    taken: list[Region] = []
    for piece in pieces:
        if count == 0:
            break
        if start >= piece.numel:
            start -= piece.numel
            continue
        take = min(piece.numel - start, count)
        taken.append(piece.part(start, take))
        start, count = 0, count - take
    if count:
        raise StageError(
            f"{where}: the fp32 partitions end {count} elements before a parameter does"
        )
    return tuple(taken)


def region_of(path: Path, tensor: torch.Tensor, what: str) -> Region:
    """The region of a tensor loaded by `describe`; `what` names it in the error if it cannot be one."""
    if not tensor.is_contiguous():
        raise StageError(
            f"{path}: {what} is stored strided (stride {tensor.stride()} for shape "
            f"{tuple(tensor.shape)}); only contiguous tensors are read"
        )
    offset = tensor.untyped_storage()._checkpoint_offset if tensor.numel() else 0
    return Region(path, offset + tensor.storage_offset() * tensor.element_size(), tensor.dtype,
                  tensor.numel())  # fmt: skip


def describe(path: Path) -> Any:
    """A checkpoint file's contents with meta tensors (no tensor data read), by the weights-only
    unpickler with the allowlist of `training.integrity`; a one-line error if it cannot be read."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="meta", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise StageError(
            f"{path}: unreadable, truncated or corrupt ({type(err).__name__})"
        ) from None


class Reader:
    """Reads `Stored` tensors as chunks of at most `chunk_bytes`, through one reusable buffer.

    A yielded chunk is a view of that buffer: it is valid until the iteration
    resumes, so a consumer converts or writes it before asking for the next.
    Files are opened once and closed when the reader is.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.buffer = bytearray(chunk_bytes)
        self.files: dict[Path, int] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:  # fmt: skip
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()

    def chunks(self, stored: Stored) -> Iterator[torch.Tensor]:
        """The tensor's elements in row-major order, in chunks of the stored dtype."""
        if not stored.pieces:  # no elements
            return
        itemsize = stored.dtype.itemsize
        size = len(self.buffer) // itemsize * itemsize
        view = memoryview(self.buffer)
        fill = 0
        for region in stored.regions():
            offset, left = region.offset, region.numel * itemsize
            while left:
                count = min(left, size - fill)
                self._read(region.path, view[fill : fill + count], offset)
                fill, offset, left = fill + count, offset + count, left - count
                if fill == size:
                    yield torch.frombuffer(self.buffer, dtype=stored.dtype, count=size // itemsize)
                    fill = 0
        if fill:
            yield torch.frombuffer(self.buffer, dtype=stored.dtype, count=fill // itemsize)

    def _read(self, path: Path, into: memoryview, offset: int) -> None:
        fd = self.files.get(path)
        if fd is None:
            fd = self.files[path] = os.open(path, os.O_RDONLY)
        done = 0
        while done < len(into):
            count = os.preadv(fd, [into[done:]], offset + done)
            if count == 0:
                raise StageError(
                    f"{path}: truncated: the checkpoint's index places {len(into)} bytes at offset "
                    f"{offset}, but the file ends at {os.fstat(fd).st_size}"
                )
            done += count
