"""Work that one rank of each host does for every rank on it.

A training stage's ranks all need some inputs that cost real time to make and come out the
same everywhere: the task families, whose files are downloaded, read, checked row by row
and sampled (`tasks.max_rows`). Eight ranks on a host would do that eight times, hitting
the hub eight times and holding eight parsers' worth of memory at once. Here the host's
local rank 0 makes the value and leaves it, pickled, in the host's temporary folder; the
host's other ranks read it after a barrier. A file rather than a broadcast over a process
group of the host's ranks: building that group is itself a collective over the world, and
a file needs nothing but the barrier the stage has anyway.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from stagetrain.io import atomic_write_bytes

T = TypeVar("T")


def once_per_host(make: Callable[[], T], *, name: str) -> T:
    """`make()` run by local rank 0 of each host; every other rank gets a copy of its value.

    `name` tells apart the values one job makes this way. If `make` raises, local rank 0
    raises; torchrun then stops the ranks that wait at the barrier. The file is removed once
    every rank has read it: the second barrier is world-wide, so a host whose temporary folder
    is shared with another (the simulated hosts of the tests) removes nothing still unread.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    # torchrun sets both in every rank, the run id alike across ranks and hosts
    tag = hashlib.sha256(f"{os.environ['TORCHELASTIC_RUN_ID']}:{name}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"stagetrain-{name}-{tag}.pickle"
    first = int(os.environ["LOCAL_RANK"]) == 0
    if first:
        value = make()
        atomic_write_bytes(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    dist.barrier()
    if not first:
        # Written by this job's own rank on this host a moment ago, never by a user: pickle's
        # objection (running what a file says) does not apply.
        value = pickle.loads(path.read_bytes())
    dist.barrier()
    if first:
        path.unlink(missing_ok=True)
    return value
