"""Benchmark: the planner's predicted CPU tokens/s against the pretrain stage's measured tokens/s.

    python benchmarks/cpu_throughput.py [--steps 60] [--precisions fp32 bf16]

Runs the real workflow (`snakemake --cores 2 pretrain`) on the default config
in a scratch copy, once per precision, with the pretraining shortened to
`--steps` steps: detect_hardware measures the matrix-product rates, the
planner predicts tokens/s from them (`planning.throughput`), and the pretrain
stage records its median measured tokens/s next to the prediction
(`pretrain/summary.json`). Prints, per precision, the measured GFLOP/s, the
prediction, the measurement and their ratio (the aim: within 0.7-1.3). With
both precisions it also fits the model's two constants to the two runs
(`parallelism.cpu_efficiency`, the share of the matrix-product rate training
reaches, and `CPU_OTHER_WORK`, the non-matrix work in units of the fp32 rate):
per rank, seconds per token = F / (P_precision x efficiency x saturation) +
F x other_work / P_fp32, two equations in two unknowns.
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
    subprocess.run([snakemake, "--cores", "2", "pretrain"], cwd=work, check=True,
                   capture_output=True, text=True)  # fmt: skip
    results = work / "results" / cfg["run"]["name"]
    from stagetrain.config import validation as stconfig

    return {
        "cpu_efficiency": stconfig.load(path)["parallelism"]["cpu_efficiency"],
        "hardware": json.loads((results / "hardware.json").read_text()),
        "plan": json.loads((results / "plan.json").read_text()),
        "summary": json.loads((results / "pretrain" / "summary.json").read_text()),
    }


def fit(rows: dict[str, dict]) -> tuple[float, float]:
    """(cpu_efficiency, other_work) that make the model reproduce the fp32 and bf16 runs."""
    from stagetrain.planning.shape import ModelShape
    from stagetrain.planning.throughput import CPU_HALF_SATURATION_TOKENS, flops_per_token

    coefficients = []
    for precision in ("fp32", "bf16"):
        out = rows[precision]
        plan, gflops = out["plan"], out["hardware"]["speed"]["gflops"]
        layout = plan["stages"]["pretrain"]["layout"]
        shape = ModelShape(**{k: v for k, v in plan["model"].items() if k in ModelShape.__slots__})
        flops = flops_per_token(shape, layout["seq_len"])
        micro = layout["micro_batch_size"] * layout["seq_len"]
        saturation = micro / (micro + CPU_HALF_SATURATION_TOKENS)
        seconds = layout["world"] / out["summary"]["tokens_per_s"]  # per token on one rank
        coefficients.append(
            (
                flops / (gflops[precision] * 1e9 * saturation),
                flops / (gflops["fp32"] * 1e9),
                seconds,
            )
        )
    (a1, b1, c1), (a2, b2, c2) = coefficients
    det = a1 * b2 - a2 * b1
    inverse_efficiency, other = (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det
    return 1 / inverse_efficiency, other


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
    if {p for p, _ in rows} >= {"fp32", "bf16"}:
        efficiency, other = fit(dict(rows))
        print(f"fitted: cpu_efficiency {efficiency:.3f}, CPU_OTHER_WORK {other:.3f}")


if __name__ == "__main__":
    main()
