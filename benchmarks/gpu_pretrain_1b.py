"""GPU benchmark: a ~1.2B Llama pretrained for a few hundred steps on this machine's GPUs,
measured against the planner's prediction.

    python benchmarks/gpu_pretrain_1b.py [--steps 200] [--out results-gpu]

It writes a config (config/presets/llama-1b-h200.yaml's model with detected
hardware, the generated corpus and a 32k BPE), runs `snakemake --cores all
pretrain` on it, then prints measured tokens/s, MFU and peak memory beside
plan.json's predicted tokens/s and memory, with their ratios. Needs a GPU;
on a CPU machine it stops with a message.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--out", default=str(REPO / "results-gpu"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_pretrain_1b: no GPU visible; run it on a GPU machine")
    preset = yaml.safe_load((REPO / "config/presets/llama-1b-h200.yaml").read_text())
    config = {
        "run": {"name": "gpu-1b", "seed": 1},
        "model": preset["model"],
        "tokenizer": {"vocab_size": 32768, "training_sample_mb": 50},
        "data": {"train_tokens": args.steps * 64 * args.seq_len + 1, "val_tokens": 200_000},
        "hardware": {"source": "detect"},
        "pretrain": {
            "seq_len": args.seq_len, "global_batch_size": 64, "steps": args.steps, "log_every": 10,
            "eval_every": args.steps, "checkpoint_every": args.steps,
            "optimizer": {"lr": 3e-4, "warmup_steps": 20},
        },
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    cmd = [snakemake, "--cores", "all", "--configfile", str(out / "config.yaml"), "--directory", str(out),
           "--snakefile", str(REPO / "Snakefile"), "pretrain"]  # fmt: skip
    subprocess.run(cmd, check=True)
    run = out / "results" / "gpu-1b"
    plan = json.loads((run / "plan.json").read_text())
    summary = json.loads((run / "pretrain/summary.json").read_text())
    records = [
        json.loads(line) for line in (run / "pretrain/metrics.jsonl").read_text().splitlines()
    ]
    peak = max(r.get("memory/max_allocated(GiB)") or 0 for r in records)
    stage = plan["stages"]["pretrain"]
    predicted = stage["throughput"]["tokens_per_s"]
    predicted_gib = stage["memory"]["total"] / 2**30
    print(f"device: {plan['world']} x {plan['device']}, layout {stage['layout']}")
    print(f"tokens/s: measured {summary['tokens_per_s']:,.0f}, predicted {predicted:,.0f}, "
          f"ratio {summary['tokens_per_s'] / predicted:.2f}")  # fmt: skip
    print(
        f"MFU: measured {summary['mfu(%)']:.1f}%, predicted {100 * stage['throughput']['mfu']:.1f}%"
    )
    print(f"peak memory: measured {peak:.1f} GiB allocated, predicted {predicted_gib:.1f} GiB, "
          f"ratio {peak / predicted_gib:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
