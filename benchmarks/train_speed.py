"""Benchmark: the pretrain stage's training step against a bare PyTorch loop, on one CPU rank.

    python -m benchmarks.train_speed      (from the repository root: it imports tests.harness)

Both loops train the same transformers model (the default config's) from the
same weights on the same windows of the same shard, with the same threads, and
are timed alternately in this one process. The bare loop is forward,
cross-entropy, backward, torch AdamW step; the stage's step is
`stagetrain.pretrain.train.train_step` on the DeepSpeed engine (ZeRO 0). Both
run in fp32 (identical maths) and in bf16 (DeepSpeed keeps fp32 master weights,
the bare loop trains bf16 weights directly). It prints tokens/s of both and the
ratio; the aim is 0.95 or better.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS, WARMUP, ROUNDS = 20, 3, 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bare(run, precision: str):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    from stagetrain.training.engine import init_weights, load_model_config

    config = load_model_config(run.spec["model_config"])
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, seed=run.spec["seed"], std=config.initializer_range)
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    seq = run.spec["pretrain"]["seq_len"]

    def step(index: int) -> None:
        from stagetrain.training.batches import read_windows

        for micro in run.sampler.rank_micro_batches(index, 0):
            tokens = torch.from_numpy(read_windows(run.train, micro, seq))
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
            (loss / len(run.sampler.rank_micro_batches(index, 0))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _timed(step, first: int) -> float:  # noqa: ANN001
    for i in range(WARMUP):
        step(first + i)
    start = time.perf_counter()
    for i in range(STEPS):
        step(first + WARMUP + i)
    return time.perf_counter() - start


def one(precision: str) -> None:
    """Time both loops for one precision (a process each: DeepSpeed's groups live per process)."""
    import json

    from stagetrain.pretrain import train
    from tests.harness import training as harness

    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        data = harness.prepare_data(Path(tmp) / "data")
        cfg = harness.small_config()
        cfg["deepspeed"]["precision"] = precision
        cfg["pretrain"].update(seq_len=128, global_batch_size=16, steps=10**6)
        run = train.setup(json.loads(_spec(data, Path(tmp) / "run", cfg).read_text()))
        stage_step = lambda i: train.train_step(run, i)  # noqa: E731
        bare_step = _bare(run, precision)
        ours = bare = float("inf")
        for r in range(ROUNDS):
            ours = min(ours, _timed(stage_step, r * 100))
            bare = min(bare, _timed(bare_step, r * 100))
        tokens = STEPS * run.layout.global_batch * run.spec["pretrain"]["seq_len"]
        print(f"{precision}: bare loop {tokens / bare:,.0f} tokens/s, pretrain step {tokens / ours:,.0f} tokens/s, "
              f"ratio {bare / ours:.2f}")  # fmt: skip


def main() -> None:
    import subprocess

    for precision in ("fp32", "bf16"):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.train_speed", precision],
            capture_output=True,
            text=True,
            check=True,
        )
        print(proc.stdout.strip().splitlines()[-1])


def _spec(data, out: Path, cfg) -> Path:  # noqa: ANN001
    from stagetrain.config.settings import DeepSpeedSettings, training_settings
    from stagetrain.io import atomic_write_json
    from stagetrain.training.deepspeed_config import render
    from stagetrain.training.launch import job_spec, pretrain_part
    from tests.harness.planning import cpu_hardware, plan_for

    cfg["parallelism"].update(
        dp=1,
        tp=1,
        zero_stage=0,
        micro_batch_size=16,
        activation_checkpointing=False,
        offload="none",
    )
    plan = plan_for(cfg, cpu_hardware(ranks=1))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan)
    atomic_write_json(
        out / "ds.json",
        render(
            stage="pretrain",
            plan=plan,
            deepspeed=DeepSpeedSettings.from_config(cfg["deepspeed"], "deepspeed"),
            training=training_settings("pretrain", cfg["pretrain"]),
        ),
    )
    # No outputs: the benchmark times steps and writes no summary, metrics or plot.
    part = pretrain_part(cfg, plan["stages"]["pretrain"]["throughput"]) | {"seed": 1}
    spec = job_spec(inputs={**data, "plan": out / "plan.json", "deepspeed_config": out / "ds.json"}, outputs={},
                    checkpoints=out / "ckpt", part=part)  # fmt: skip
    atomic_write_json(out / "job.json", spec)
    return out / "job.json"


if __name__ == "__main__":
    one(sys.argv[1]) if len(sys.argv) > 1 else main()
