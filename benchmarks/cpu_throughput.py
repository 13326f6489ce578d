"""Benchmark: the planner's predicted CPU tokens/s against the pretrain stage's measured tokens/s.

    python benchmarks/cpu_throughput.py [--steps 60] [--precisions fp32 bf16]

Runs the real workflow (`snakemake --cores 2 pretrain`) on the default config
in a scratch copy, once per precision, with the pretraining shortened to
`--steps` steps: detect_hardware measures the matrix-product rates, the
planner predicts tokens/s from them (`planning.throughput`), and the pretrain
stage records its median measured tokens/s next to the prediction
(`pretrain/summary.json`). Prints, per precision, the measured GFLOP/s, the
prediction, the measurement and their ratio (the aim: within 0.7-1.3), and per
run the `CPU_OTHER_S_PER_FLOP` (the non-matrix work per model FLOP) that would
reproduce that run alone. The model, per rank: seconds per token =
F_dense x (1 / (P_precision x cpu_efficiency x saturation) + other_s_per_flop)
+ F_attention x (the attention probe's seconds per FLOP in the plan's precision
and kernel), with F_attention = 12 L h s and F_dense the rest of the model FLOPs.
tests/test_precision.py holds every recorded run to the 0.7-1.3 band.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles")


def run(precision: str, steps: int, root: Path) -> dict:
    """One shortened default run in `precision`; its hardware speed, plan and summary."""
    work = root / precision
    work.mkdir()
    for part in PARTS:
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, work / part)
    path = work / "config" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["deepspeed"]["precision"] = precision
    cfg["pretrain"].update(steps=steps, log_every=10, eval_every=steps, checkpoint_every=steps)
    cfg["pretrain"]["optimizer"]["warmup_steps"] = min(steps, 30)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    # plan.json is the plan's whole record, which no stage reads: the `plan` target writes it.
    subprocess.run([snakemake, "--cores", "2", "pretrain", "plan"], cwd=work, check=True,
                   capture_output=True, text=True)  # fmt: skip
    results = work / "results" / cfg["run"]["name"]
    from stagetrain.config import validation as stconfig

    return {
        "cpu_efficiency": stconfig.load(path)["parallelism"]["cpu_efficiency"],
        "hardware": json.loads((results / "hardware.json").read_text()),
        "plan": json.loads((results / "plan.json").read_text()),
        "summary": json.loads((results / "pretrain" / "summary.json").read_text()),
    }


def implied_other_work(out: dict) -> float:
    """The CPU_OTHER_S_PER_FLOP that would make the model reproduce this run alone, with its
    cpu_efficiency and its attention probe's time as the plan used them."""
    from stagetrain.planning.shape import ModelShape
    from stagetrain.planning.throughput import (
        CPU_OTHER_S_PER_FLOP,
        attention_flops_per_token,
        flops_per_token,
    )

    plan = out["plan"]
    layout = plan["stages"]["pretrain"]["layout"]
    shape = ModelShape(**{k: v for k, v in plan["model"].items() if k in ModelShape.__slots__})
    attention = attention_flops_per_token(
        shape.hidden_size, layout["seq_len"], layers=shape.num_layers
    )
    dense = flops_per_token(shape, layout["seq_len"]) - attention
    predicted = layout["world"] / out["summary"]["predicted_tokens_per_s"]  # s/token, one rank
    measured = layout["world"] / out["summary"]["tokens_per_s"]
    return CPU_OTHER_S_PER_FLOP + (measured - predicted) / dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(p, run(p, args.steps, Path(tmp))) for p in args.precisions]
    print("precision  GFLOP/s/rank  predicted  measured  measured/predicted  cpu_efficiency alone")
    for precision, out in rows:
        summary = out["summary"]
        ratio = summary["tokens_per_s_over_predicted"]
        efficiency = ratio * out["cpu_efficiency"] if ratio else None
        gflops = out["hardware"]["speed"]["gflops"][precision]
        print(f"{precision:9}  {gflops:12,.1f}  {summary['predicted_tokens_per_s'] or 0:9,.0f}  "
              f"{summary['tokens_per_s']:8,.0f}  {ratio or float('nan'):18.2f}  {efficiency or float('nan'):.3f}")  # fmt: skip
    print(json.dumps({p: o["hardware"]["speed"] for p, o in rows}))
    for precision, out in rows:
        print(
            f"{precision}: CPU_OTHER_S_PER_FLOP that fits this run alone {implied_other_work(out):.3g}"
        )


if __name__ == "__main__":
    main()
