"""Slurm: what a training or consolidation job asks for.

`job_resources` turns plan.json into the resources snakemake-executor-plugin-slurm
submits with (nodes, tasks, CPUs, GPUs, memory); the workflow calls it just
before a training job is submitted, once plan.json exists. Which hosts and CPUs a
running job holds is the hardware's side (`hardware.allocation`).

Geometry: one Slurm task per rank (`--ntasks-per-node` = ranks per node), so
Slurm reserves each rank's CPUs and GPU; the launcher then starts one srun step
with one task per node, in which torchrun starts that node's ranks. Such a job
carries `mpi="srun"`, which tells the plugin not to wrap the job in an srun of
its own (an srun inside that step would wait for CPUs the outer step holds).
"""

from __future__ import annotations

import math
from typing import TypedDict

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.planning.plan import PlanRecord, verifies_on_gpu

RANK_HOST_MB = 4096
"""Host memory of one rank beyond its model state. In the default run each CPU rank
holds 0.9 GiB and torchrun 0.5 GiB (ps); 4 GiB leaves room for a CUDA context,
larger vocabularies and checkpoint writes."""

VERIFY_BYTES_PER_PARAM = {"bf16": 2, "fp32": 4}
"""The loss verification's reloaded model: one copy of each weight in the output
dtype (transformers builds the model on the meta device and loads each weight
once; docs/benchmarks.md has the measured figure)."""

MiB = 2**20
TRAINING_RESOURCES = (
    "nodes",
    "tasks",
    "tasks_per_node",
    "cpus_per_task",
    "mem_mb",
    "gres",
    "tasks_per_gpu",
    "mpi",
    "runtime",
)
CONSOLIDATE_RESOURCES = ("mem_mb", "gres", "tasks_per_gpu")


class Resources(TypedDict):
    """A training job's Slurm resources, one key per `TRAINING_RESOURCES` (None: not asked)."""

    nodes: int
    tasks: int | None
    tasks_per_node: int | None
    cpus_per_task: int
    mem_mb: int
    gres: str | None
    tasks_per_gpu: int | None
    mpi: str | None
    runtime: int | None


def job_resources(plan: PlanRecord, stage: str, node_cores: int | None, steps: int) -> Resources:
    """The Slurm resources of a training stage's job, from plan.json.

    Args:
        plan: plan.json.
        stage: "pretrain" or "grpo" (each has its own memory estimate).
        node_cores: CPU cores of one training node (hardware.json); None when the
            hardware was described rather than detected: Slurm's default CPUs then.
        steps: the stage's optimizer steps (for the runtime).

    Keys a job does not need are None, which Snakemake drops; `tasks` and
    `tasks_per_node` are never both set (the plugin refuses that for srun jobs).
    """
    nodes, per_node = plan["nodes"], plan["ranks_per_node"]
    memory = plan["stages"][stage]["memory"]
    host_bytes = memory["host_per_node"] + (
        memory["total"] * per_node if plan["device"] == "cpu" else 0
    )
    several = nodes * per_node > 1
    gpu = plan["device"] != "cpu"  # a GPU catalog key otherwise
    return {
        "nodes": nodes,
        "tasks": None if per_node > 1 else nodes,
        "tasks_per_node": per_node if per_node > 1 else None,
        # -1 makes the plugin leave --cpus-per-task out.
        "cpus_per_task": max(1, node_cores // per_node) if node_cores else -1,
        "mem_mb": -(-host_bytes // MiB) + RANK_HOST_MB * per_node,
        "gres": f"gpu:{per_node}" if gpu else None,
        # The plugin turns `tasks` into --ntasks-per-gpu for GPU jobs unless this is 0.
        "tasks_per_gpu": 0 if gpu else None,
        "mpi": "srun" if several else None,
        "runtime": runtime_minutes(plan, stage, steps),
    }


def runtime_minutes(plan: PlanRecord, stage: str, steps: int) -> int | None:
    """Minutes to ask for: twice the plan's predicted training time, plus 30 for start-up,
    evaluations and checkpoints. None where the plan predicts no step time (CPU ranks;
    GRPO, whose rollouts it does not model): the profile's runtime then applies."""
    throughput = plan["stages"][stage]["throughput"]
    if stage != "pretrain" or "step_s" not in throughput:
        return None
    return math.ceil(2 * steps * throughput["step_s"] / 60) + 30


class ConsolidateResources(TypedDict):
    """A consolidation job's Slurm resources, one key per `CONSOLIDATE_RESOURCES` (None: not asked)."""

    mem_mb: int
    gres: str | None
    tasks_per_gpu: int | None


def consolidate_resources(
    plan: PlanRecord, consolidate: ConsolidateSettings
) -> ConsolidateResources:
    """A consolidation job's Slurm resources: its host memory, and one GPU where the plan trains on
    GPUs and the loss verification's model and logits fit one of them with a fifth to spare
    (`planning.plan.verifies_on_gpu`, by which the stage then runs it there)."""
    mem_mb = consolidate_mem_mb(plan, consolidate)
    device = plan["stages"]["pretrain"]["memory"]["device"]
    gpu = plan["device"] != "cpu" and consolidate.verify == "loss"
    one = gpu and verifies_on_gpu((mem_mb - RANK_HOST_MB) * MiB, device)
    # tasks_per_gpu 0: the plugin would otherwise add --ntasks-per-gpu (see job_resources).
    return {"mem_mb": mem_mb, "gres": "gpu:1" if one else None, "tasks_per_gpu": 0 if one else None}


def consolidate_mem_mb(plan: PlanRecord, consolidate: ConsolidateSettings) -> int:
    """Host memory of a consolidation job (`consolidate`: the config's section).

    Reading the checkpoint and writing the shards stream a few MiB at a time, so
    only the loss verification grows with the model: the reloaded model, and one
    micro batch of logits (in the output dtype, an fp32 copy and the
    cross-entropy's log-probabilities). 4 GiB covers the libraries and the rest.
    """
    if consolidate.verify != "loss":
        return RANK_HOST_MB
    per_param = VERIFY_BYTES_PER_PARAM[consolidate.dtype]
    tokens = max(
        s["layout"]["micro_batch_size"] * s["layout"]["seq_len"] for s in plan["stages"].values()
    )
    logits = tokens * plan["model"]["vocab_size"] * (per_param + 8)
    return -(-(plan["model"]["params"] * per_param + logits) // MiB) + RANK_HOST_MB
