"""The pretraining loop, run on every rank by torchrun: `python -m stagetrain.pretrain.train --spec job.json`.

The spec (`training.spec.PretrainJob`, written by scripts/pretrain.py) names
the artifacts to read and write and carries the config sections. Rank 0 writes
the metrics, the summary (`pretrain.summary.PretrainSummary`) and the loss plot;
every rank takes part in forward, backward, step, evaluation and checkpointing,
since under ZeRO-3 or AutoTP none can do them alone.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from transformers.integrations import HfDeepSpeedConfig

from stagetrain.config.settings import ModelSettings, PretrainSettings
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.errors import StageError
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.planning.plan import Layout
from stagetrain.planning.shape import ModelShape
from stagetrain.planning.throughput import flops_per_token
from stagetrain.pretrain.metrics import METRICS, PretrainRecord
from stagetrain.pretrain.plot import loss_plot
from stagetrain.pretrain.summary import ExpertsSummary, ParamRecord, PretrainSummary
from stagetrain.training import engine as engines
from stagetrain.training.batches import Sampler, window_count
from stagetrain.training.checkpoints import Checkpoints, ClientState
from stagetrain.training.deepspeed_config import DeepSpeedJson
from stagetrain.training.engine import ParamCounts
from stagetrain.training.evaluation import validation_loss, window_loss
from stagetrain.training.experts import (
    Routing,
    RoutingStep,
    balance_routers,
    expert_shares,
    load_stats,
    router_biases,
    routing_of,
    training_loss,
)
from stagetrain.training.loop import StageLoop, quiet_other_ranks
from stagetrain.training.metrics import (
    MetricsLog,
    Progress,
    check_finite,
    max_rss_gib,
    window_log_on,
)
from stagetrain.training.rank import rank_main
from stagetrain.training.spec import PretrainJob

log = logging.getLogger("stagetrain")
WINDOW_RECORD = {
    "step": "optimizer steps completed",
    "windows": "window ids read, dp ranks in order",
}
NOT_MATHS = ("checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches", "log_every")


class WindowRecord(TypedDict):
    """One record of the debug log windows.jsonl (WINDOW_RECORD says what each key means)."""

    step: int
    windows: list[list[int]]


class PretrainClient(ClientState):
    """What pretrain's checkpoints carry beside DeepSpeed's state: the last validation loss
    measured (None before the first evaluation)."""

    eval_loss: float | None


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once by `setup`."""

    spec: PretrainJob
    cfg: PretrainSettings
    engine: DeepSpeedEngine
    device: torch.device
    layout: Layout
    sampler: Sampler
    dp_rank: int
    train: np.ndarray
    eval_windows: np.ndarray
    val: np.ndarray
    loop: StageLoop[PretrainRecord, PretrainClient]
    flops_per_token: float
    peak_flops: float | None
    params: ParamCounts
    """After construction: this rank's parameter elements and the model's."""
    predicted_tokens_per_s: float | None
    """The planner's (`predicted_tokens_per_s`)."""
    routing: Routing | None
    """An MoE model's routing (its load balancing and expert load); None when dense."""
    zero3_config: HfDeepSpeedConfig | None
    """Held for the run's life under ZeRO-3: transformers keeps only a weak reference to it."""


def components(
    spec: PretrainJob, meta: TokenizerMeta, ds_config: DeepSpeedJson, init_from: str | None
) -> dict[str, Any]:
    """What the checkpoint fingerprint is made of: everything that changes the maths. Plain JSON
    as each part is written (model_config.json, the pretrain section less NOT_MATHS): the
    fingerprint hashes it, so a key no type names still changes it."""
    sections: Mapping[str, Any] = ds_config  # read by name below
    return {
        "model_config": json.loads(Path(spec["model_config"]).read_text()),
        "init_from": init_from,
        "tokenizer": meta["tokenizer_sha256"],
        "data": meta["train"]["sha256"],
        "training": {k: v for k, v in spec["pretrain"].items() if k not in NOT_MATHS},
        "precision": [k for k in ("bf16", "fp16") if sections.get(k, {}).get("enabled")]
        or ["fp32"],
        # DeepSpeed counts AutoTP ranks in its batch size; the sequences per step do not depend on tp
        "global_batch": ds_config["train_batch_size"]
        // ds_config.get("tensor_parallel", {}).get("autotp_size", 1),
        "seed": spec["seed"],
    }


def setup(spec: PretrainJob) -> Run:
    """Start the process group, check the world against the plan, build the engine and the data."""
    plan, meta, ds_config, device = engines.join_world(spec)
    cfg = PretrainSettings.from_config(spec["pretrain"], "pretrain")
    init_from = ModelSettings.from_config(spec["model"], "model").init_from
    layout = Layout.from_plan(plan, "pretrain")
    checkpoints = Checkpoints(Path(spec["checkpoints"]), components(spec, meta, ds_config, init_from),
                              layout.checkpoint_layout, cfg.keep_checkpoints)  # fmt: skip
    checkpoints.hold()  # before anything is built or written: a second run of the stage stops here
    config = engines.load_model_config(spec["model_config"])
    engine, params, zero3_config = engines.build(
        config=config, ds_config=ds_config, init_from=init_from,
        activation_checkpointing=layout.activation_checkpointing, seed=spec["seed"],
        attention=plan["attention"],
    )  # fmt: skip
    if engine.dp_world_size != layout.dp:
        raise StageError(
            f"plan.json: dp={layout.dp}, but DeepSpeed formed dp={engine.dp_world_size}"
        )
    seq = layout.seq_len  # the plan's, which its memory and throughput were worked out for
    train = np.memmap(spec["train"], dtype=meta["dtype"], mode="r")
    val = np.memmap(spec["val"], dtype=meta["dtype"], mode="r")
    n_eval = min(window_count(len(val), seq), cfg.eval_batches * layout.micro_batch_size)
    if n_eval == 0:
        raise StageError(f"{spec['val']}: fewer than {seq + 1} tokens, not one validation window")
    planned: Mapping[str, Any] = plan["model"]  # ModelShape's fields and more
    shape = ModelShape(**{k: v for k, v in planned.items() if k in ModelShape.__slots__})
    return Run(
        spec=spec, cfg=cfg, engine=engine, device=device, layout=layout,
        dp_rank=dist.get_rank(group=engine.data_parallel_group),
        sampler=Sampler(windows=window_count(len(train), seq), global_batch=layout.global_batch,
                        dp=layout.dp, micro_batch_size=layout.micro_batch_size, seed=spec["seed"]),
        train=train, val=val, eval_windows=np.arange(n_eval),
        loop=StageLoop(stage="pretrain", spec=spec, cfg=cfg, engine=engine, checkpoints=checkpoints),
        flops_per_token=flops_per_token(shape, seq),
        peak_flops=gpu_spec(plan["device"]).peak_tflops * 1e12 * plan["world"] if plan["device"] != "cpu" else None,
        params=params, predicted_tokens_per_s=predicted_tokens_per_s(spec), routing=routing_of(config),
        zero3_config=zero3_config,
    )  # fmt: skip


def predicted_tokens_per_s(spec: PretrainJob) -> float | None:
    """The planner's prediction for this layout (`spec["throughput"]`, plan.json's estimate: the
    part of the plan the stage depends on leaves the estimates out, `planning.derived`)."""
    throughput = spec["throughput"]
    if "tokens_per_s" not in throughput:  # no prediction: its reason instead
        return None
    return throughput["tokens_per_s"]


def loss_on(run: Run, windows: np.ndarray, shard: np.ndarray) -> torch.Tensor:
    """The training loss of `run`'s model on `windows` of `shard`."""
    return window_loss(run.engine, run.device, shard, windows, run.layout.seq_len)


def evaluate(run: Run) -> float:
    """Loss on the fixed validation windows, the same on every rank."""
    run.engine.eval()
    loss = validation_loss(run.engine, run.val, run.eval_windows, seq_len=run.layout.seq_len,
                           micro_batch_size=run.layout.micro_batch_size, device=run.device)  # fmt: skip
    run.engine.train()
    return loss


def train_step(
    run: Run, step: int, windows: MetricsLog[WindowRecord] | None = None
) -> tuple[float, RoutingStep | None]:
    """One optimizer step over this rank's micro batches: the language-model loss averaged over
    all ranks, and for an MoE model the aux loss and expert load (`training.experts`; None for
    a dense one). A router balanced by a bias has it moved once the optimizer has stepped, from
    the step's tokens per expert summed over all ranks (`experts.balance_routers`).

    With the window log on (`window_log_on`), the windows every rank read are
    gathered and rank 0 appends them to `windows`.
    """
    read: list[int]
    losses, counts, read = [], [], []
    routing = run.routing
    for micro in run.sampler.rank_micro_batches(step, run.dp_rank):
        if routing:
            loss, lm, aux, routed = training_loss(run.engine, run.device, run.train, micro,
                                                  run.layout.seq_len, routing)  # fmt: skip
            kept = [lm] if aux is None else [lm, aux]  # an aux loss where the architecture has one
            losses.append(torch.stack([t.detach().float() for t in kept]))
            counts.append(routed)
        else:
            loss = loss_on(run, micro, run.train)
            losses.append(loss.detach().float().reshape(1))
        run.engine.backward(loss)
        run.engine.step()
        read.extend(int(i) for i in micro)
    mean = torch.stack(losses).mean(0)
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    if window_log_on():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (run.dp_rank, read))
        if windows:  # ranks of one tp group read the same windows: one entry per dp rank
            by_dp = dict(every)
            windows.write({"step": step + 1, "windows": [by_dp[r] for r in sorted(by_dp)]})
    world = dist.get_world_size()
    if not routing:
        return mean[0].item() / world, None
    # Whole counts, so the bias update's signs are exact; a tp group counts its tokens tp
    # times, which leaves the shares and the signs as they are.
    load = torch.stack(counts).sum(0)
    dist.all_reduce(load, op=dist.ReduceOp.SUM)
    if routing.bias_rate:
        balance_routers(run.engine.module, load, routing.bias_rate)
    aux = mean[1].item() / world if routing.coef is not None else None
    return mean[0].item() / world, RoutingStep(aux, load_stats(expert_shares(load)))


def record(
    run: Run, step: int, loss: float, seconds: float, tokens: int, elapsed: float
) -> PretrainRecord:
    """One metrics record for `step`."""
    rate = tokens / seconds if seconds > 0 else 0.0
    grad_norm = run.engine.get_global_grad_norm()
    out: PretrainRecord = {
        "step": step, "train/loss": loss, "train/lr": run.engine.get_lr()[0],
        "train/grad_norm": float(grad_norm) if grad_norm is not None else None,
        "train/tokens": step * run.layout.tokens_per_step,
        "throughput/tokens_per_s": rate,
        "throughput/mfu(%)": 100 * run.flops_per_token * rate / run.peak_flops if run.peak_flops else None,
        "time/elapsed_s": elapsed,
    }  # fmt: skip
    if run.device.type == "cuda":
        out["memory/max_allocated(GiB)"] = torch.cuda.max_memory_allocated() / 2**30
        out["memory/max_reserved(GiB)"] = torch.cuda.max_memory_reserved() / 2**30
        torch.cuda.reset_peak_memory_stats()
    else:
        out["memory/max_rss(GiB)"] = max_rss_gib()
    return out


def loop(run: Run) -> None:
    """Train from the latest checkpoint (or step 0) to the configured steps."""
    cfg, stage = run.cfg, run.loop
    client = stage.resume(METRICS)
    run.eval_windows = stage.eval_set(run.eval_windows, client)
    windows = stage.debug_log("windows.jsonl", WINDOW_RECORD)
    progress, began = Progress(cfg.steps, stage.start), time.monotonic()
    tokens_per_step = run.layout.tokens_per_step
    last_eval, window_s, window_steps = None, 0.0, 0
    for step in stage.steps():
        t0 = time.monotonic()
        loss, routed = train_step(run, step - 1, windows)
        finite: dict[str, Any] = {
            "stage": "pretrain",
            "step": step,
            "precision": run.layout.precision,
        }
        check_finite(loss, what="training loss", **finite)
        window_s, window_steps = window_s + time.monotonic() - t0, window_steps + 1
        evaluating = stage.evaluates(step)
        if evaluating or stage.logs(step):
            # tokens/s over the training time since the last record (evaluation and saving excluded)
            entry = record(run, step, loss, window_s, window_steps * tokens_per_step,
                           time.monotonic() - began)  # fmt: skip
            if routed:
                entry |= routed.load
                if routed.aux_loss is not None:
                    entry["train/aux_loss"] = routed.aux_loss
            window_s, window_steps = 0.0, 0
            if evaluating:
                entry["eval/loss"] = last_eval = evaluate(run)
                check_finite(last_eval, what="validation loss", **finite)
            if stage.metrics:
                stage.metrics.write(entry)
                log.info(progress.line(step, loss, entry["throughput/tokens_per_s"]))
        stage.checkpoint(step, {"step": step, "eval_loss": last_eval})


def checksum(module: torch.nn.Module) -> list[float]:
    """(sum, sum of squares) of the parameters this rank holds and of its routing biases
    (`experts.router_biases`: state no gradient keeps equal, held whole on every rank), in
    float64.

    Data-parallel ranks under ZeRO 0-2 hold full copies that must stay equal;
    comparing these across ranks catches copies that drifted apart. Under ZeRO-3
    and AutoTP each rank holds a different shard, and the numbers differ by design.
    """
    total, squares = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for param in [*module.parameters(), *router_biases(module)]:
        values = param.detach().double().cpu()
        total += values.sum()
        squares += values.pow(2).sum()
    return [total.item(), squares.item()]


def final_params(run: Run) -> ParamRecord:
    """The parameters at the end, on every rank (all take part in the gathers): the dtypes (the
    optimizer states exist only now), and each rank's element count and `checksum`."""
    dtypes = engines.dtypes(run.engine)
    gathered: dict[str, list[Any]] = {}
    for key, value in (("local_param_elements", run.params["local_param_elements"]),
                       ("param_checksum", checksum(run.engine.module))):  # fmt: skip
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, value)
        gathered[key] = every
    return {**run.params, "dtypes": dtypes,
            "local_param_elements_per_rank": gathered["local_param_elements"],
            "param_checksum_per_rank": gathered["param_checksum"]}  # fmt: skip


def summarise(run: Run, params: ParamRecord) -> PretrainSummary:
    """summary.json: the stage's declared output."""
    records = run.loop.records()
    rates = [r["throughput/tokens_per_s"] for r in records[1:]] or [
        records[0]["throughput/tokens_per_s"]
    ]
    mfus = [r["throughput/mfu(%)"] for r in records[1:] if r.get("throughput/mfu(%)") is not None]
    predicted = run.predicted_tokens_per_s
    final_eval_loss = [r["eval/loss"] for r in records if "eval/loss" in r][-1]
    return {
        **run.loop.summary(final_eval_loss=final_eval_loss, layout=run.layout),
        "final_loss": records[-1]["train/loss"],
        "losses": {r["step"]: r["train/loss"] for r in records},
        "eval_losses": {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r},
        "tokens_per_s": float(np.median(rates)),
        "tokens_per_s_over_predicted": float(np.median(rates)) / predicted if predicted else None,
        "mfu(%)": float(np.median(mfus)) if mfus else None,
        "mfu_reason": None if mfus else "no MFU on CPUs or GPUs missing from the catalog",
        "experts": experts_summary(run, records),
        "predicted_tokens_per_s": predicted,
        **params,
    }  # fmt: skip


def experts_summary(run: Run, records: list[PretrainRecord]) -> ExpertsSummary | None:
    """An MoE run's routing, its expert load at the last record (the final imbalance) and the
    imbalance at each record (for the loss plot); None for a dense model."""
    if run.routing is None:
        return None
    last = records[-1]
    return {"experts": run.routing.experts, "top_k": run.routing.top_k, "aux_loss_coef": run.routing.coef,
            "bias_update_rate": run.routing.bias_rate,
            "final_aux_loss": last.get("train/aux_loss"), "final_load_entropy": last["moe/load_entropy"],
            "final_load_max_over_mean": last["moe/load_max_over_mean"], "final_load_by_layer": last["moe/load_by_layer"],
            "load_max_over_mean": {r["step"]: r["moe/load_max_over_mean"] for r in records}}  # fmt: skip


def rank(spec: PretrainJob) -> None:
    """One rank of the pretrain stage: train, then (rank 0) write the outputs."""
    run = setup(spec)
    quiet_other_ranks()
    loop(run)
    params = final_params(run)
    if dist.get_rank() == 0:
        run.loop.write_outputs(summarise(run, params), loss_plot, spec["loss_plot"])


if __name__ == "__main__":
    rank_main(rank)
