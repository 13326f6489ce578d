"""The Slurm allocation a process runs in: its job, hosts and CPUs per node.

What the hardware detection reports for a job (`hardware.detect`) and what the launcher
starts its ranks on (`training.launch`); read from the job's SLURM_* variables, else from
`scontrol show job`. What a job asks Slurm for is the workflow's side (`workflow.slurm`).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from stagetrain.errors import StageError


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ('n[01-03,7],gpu5') as host names, in order."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


@dataclass(frozen=True, slots=True)
class Allocation:
    """The Slurm job this process runs in."""

    job_id: str
    hosts: list[str]
    cpus_per_node: int | None
    """CPUs the job holds on each node, when Slurm says (None: let srun choose)."""


def allocation(
    env: Mapping[str, str], scontrol: Callable[[str], str] | None = None
) -> Allocation | None:
    """The allocation from SLURM_* variables, else from `scontrol show job`; None outside Slurm.

    The executor plugin's job step keeps only SLURM_JOB_ID of the job's
    variables, so the node list and CPU count are asked of the controller then.
    """
    job_id = env.get("SLURM_JOB_ID")
    if job_id is None:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST")
    cpus = env.get("SLURM_JOB_CPUS_PER_NODE")
    if nodelist is None or cpus is None:
        fields = _job_fields((scontrol or _scontrol)(job_id))
        nodelist = nodelist or fields.get("NodeList")
        if cpus is None and "NumCPUs" in fields and "NumNodes" in fields:
            cpus = str(int(fields["NumCPUs"]) // int(fields["NumNodes"].split("-")[0]))
    if not nodelist:
        raise StageError(f"Slurm job {job_id}: no node list in SLURM_JOB_NODELIST or scontrol")
    # SLURM_JOB_CPUS_PER_NODE is like '4(x2),2': the first node's count stands for all.
    count = cpus.split("(")[0].split(",")[0] if cpus else ""
    return Allocation(job_id, expand_nodelist(nodelist), int(count) if count.isdigit() else None)


def _scontrol(job_id: str) -> str:
    try:
        return subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise StageError(f"Slurm job {job_id}: scontrol show job failed: {err}") from err


def _job_fields(text: str) -> dict[str, str]:
    """`scontrol show job --oneliner` as key -> value (values hold no spaces there)."""
    return dict(part.split("=", 1) for part in text.split() if "=" in part)
