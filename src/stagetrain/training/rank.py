"""The entry of every training rank, and the death signal that ties each link to its parent.

A rank is started by torchrun (stagetrain.training.launch builds the command);
`rank_main` is what the stage's module runs under `if __name__ == "__main__"`.
Why every link asks the kernel for a death signal: stagetrain.training.launch's
module docstring.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from stagetrain.errors import StageError
from stagetrain.training.spec import JobSpec

J = TypeVar("J", bound=JobSpec)
"""A stage's job spec type (`spec.PretrainJob`, `spec.GrpoJob`)."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def _orphaned_rank() -> bool:
    """Whether torchrun started this rank but its agent died before `die_with_parent` ran.

    torchrun sets TORCHELASTIC_RUN_ID in every rank; a rank whose parent is no
    longer a torchrun agent (now init or a subreaper) was orphaned while it imported.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    return b"torch.distributed.run" not in parent and b"torchrun" not in parent


def rank_main(body: Callable[[J], None], argv: list[str] | None = None) -> None:
    """The entry of every training rank: read --spec, run `body(spec)`, turn bad input into one line.

    First the rank arranges to be SIGKILLed when its torchrun agent dies (module
    docstring), and leaves at once if the agent is already gone. A `StageError`
    is printed as `error: ...` (which `run_ranks` surfaces) with
    exit status 1; the process group is torn down whatever happens. A rank that
    got this far leaves with os._exit, skipping C++ static destructors: ranks that
    had written every artifact have died there with "terminate called without an
    active exception" (a communication thread still joinable; seen twice in CI,
    MoE under ZeRO-3 and a consolidation fixture), failing a finished stage.
    Everything is written and closed by then; only stdout and stderr need a flush.
    """
    import argparse
    import json

    import torch.distributed as dist

    die_with_parent(signal.SIGKILL)
    if _orphaned_rank():
        os._exit(1)
    parser = argparse.ArgumentParser(description="a training stage's rank (started by torchrun)")
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args(argv).spec).read_text())
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    status = 0
    try:
        body(spec)
    except StageError as err:
        # One write of the whole line: every rank says it into one pipe, and a line printed
        # in two writes (text, then newline, as print does unbuffered) interleaved with its twin.
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"error: {err}\n".encode())
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
