"""Atomic file writes, and the JSON-lines reader the stages share.

Every artifact is written to a temporary file in the same directory and then
renamed over the target, so a killed stage never leaves a half-written file that
a later run (or Snakemake's timestamp logic) would take for a finished one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from stagetrain.errors import StageError


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` atomically (same-directory temp file, fsync, rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give artifacts the usual mode
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_dir(path: str | os.PathLike[str]) -> None:
    """Give a folder made by mkdtemp (0700) the usual mode."""
    os.chmod(path, 0o777 & ~_umask())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj: Any) -> bytes:
    """`obj` as the bytes every JSON artifact is written in: indented, keys sorted, a newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON atomically, so reruns give identical bytes."""
    atomic_write_bytes(path, json_bytes(obj))


T = TypeVar("T")


def kept_json(
    path: Path, compute: Callable[[], T], load: Callable[[Any], T], dump: Callable[[T], Any]
) -> T:
    """What `path` keeps (read back by `load`), else `compute()`, kept there for the next process.

    For what Snakemake's own process works out on every command and can key by everything it
    follows from (a model's counted shape, a source's imports): a missing, torn or unreadable
    file, or one `load` refuses with ValueError or TypeError, is computed again and rewritten."""
    try:
        return load(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    value = compute()
    atomic_write_json(path, dump(value))
    return value


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON artifact, turning a missing or malformed file into a one-line StageError."""
    from stagetrain.errors import StageError

    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise StageError(f"{path}: file not found") from None
    except json.JSONDecodeError as err:
        raise StageError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None


def not_utf8(where: str, data: bytes, err: UnicodeDecodeError, offset: int = 0) -> StageError:
    """The one-line error for bytes that are not UTF-8: the first bad byte and its offset in the
    file (`offset`: where `data` starts in it)."""
    return StageError(
        f"{where}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset {offset + err.start})"
    )


def json_lines(lines: Iterable[bytes], shown: str) -> Iterator[tuple[str, Any]]:
    """(where, value) of each non-blank line of a JSON-lines stream read as bytes (so a bad
    byte's offset in the file is known); `where` is 'shown:line'. A line that is not UTF-8 or
    not JSON is a one-line StageError naming it."""
    offset = 0
    for number, raw in enumerate(lines, 1):
        where = f"{shown}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise not_utf8(where, raw, err, offset) from None
        offset += len(raw)
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise StageError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
        yield where, value
