"""Benchmark: what GRPO on the curriculum's families costs the corpus's other families, and the
levers against it, on the default run.

    python -m benchmarks.grpo_forgetting [--seeds 1234 1 2] [--variants none kl replay both]
                                         [--kl 0.05] [--replay 0.25] [--out results/forgetting]

For each seed, the default pipeline (config/config.yaml, run.seed = the seed, run.name
forgetting-s<seed>) is run through Snakemake once; then, for each variant, only its GRPO stage
and consolidation rerun on the same pretrained model:

    none     the default config's grpo section without a KL term (grpo.kl_coef = 0)
    kl       grpo.kl_coef = --kl (k3 to a frozen copy of the start model, on every completion)
    replay   grpo.replay.share = --replay (the corpus's other families mixed into the prompts)
    both     the two together
    kl+tis   kl, with the sampler correction grpo.sampler_correction = {cap: 2}

Each variant's GRPO summary is copied to <out>/s<seed>-<variant>.json. Prints, per seed and
variant, the held-out gain over the curriculum's families with its standard error, every
other family's change in its own standard errors, and the GRPO stage's wall time (its
Snakemake benchmark file) as a ratio to `none` of the same seed, so the reference's cost is
read side by side. Last line: one JSON object with the rows.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

VARIANTS = ("none", "kl", "replay", "both", "kl+tis")


def grpo_changes(variant: str, kl: float, replay: float) -> dict[str, Any]:
    """The grpo keys a variant sets over the default config."""
    out: dict[str, Any] = {}
    out["kl_coef"] = kl if variant in ("kl", "both", "kl+tis") else 0.0
    if variant in ("replay", "both"):
        out["replay"] = {"share": replay}
    if variant == "kl+tis":
        out["sampler_correction"] = {"cap": 2.0}
    return out


def run_variant(seed: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run (or rerun) the pipeline for one seed and variant; its GRPO summary and wall time."""
    name = f"forgetting-s{seed}"
    overlay = {
        "run": {"name": name, "seed": seed},
        "grpo": grpo_changes(variant, args.kl, args.replay),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(overlay, f)
    command = [sys.executable, "-m", "snakemake", "--cores", "all", "all",
               "--configfile", "config/config.yaml", f.name]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    Path(f.name).unlink()
    if done.returncode:
        sys.exit(f"seed {seed} {variant}: snakemake failed:\n{done.stderr[-3000:]}")
    run = Path("results") / name
    target = Path(args.out) / f"s{seed}-{variant}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "grpo/summary.json", target)
    with open(run / "benchmarks/grpo.tsv") as tsv:
        seconds = float(next(csv.DictReader(tsv, delimiter="\t"))["s"])
    return {"summary": json.loads(target.read_text()), "grpo_s": seconds}


def row(seed: int, variant: str, result: dict[str, Any], base_s: float) -> dict[str, Any]:
    """One table row: the curriculum's mean gain and every other family's change in se."""
    gain = result["summary"]["accuracy"]["gain"]
    mean = gain["mean"]
    others = {
        f"{family}/{level}": {"change": e["gain"], "sigmas": e["gain"] / e["se"] if e["se"] else 0.0}
        for family, levels in gain["by_family"].items() if family not in mean["families"]
        for level, e in levels.items()
    }  # fmt: skip
    return {"seed": seed, "variant": variant, "gain": mean["gain"], "se": mean["se"],
            "others": others, "grpo_s": result["grpo_s"], "time_ratio": result["grpo_s"] / base_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:4]))
    parser.add_argument("--kl", type=float, default=0.05)
    parser.add_argument("--replay", type=float, default=0.25)
    parser.add_argument("--out", default="results/forgetting")
    args = parser.parse_args()
    rows = []
    print(
        f"{'seed':>5} {'variant':<7} {'gain':>7} {'se':>6}  {'other families (change, se)':<40} {'grpo s':>7} {'x none':>7}"
    )
    for seed in args.seeds:
        base_s = None
        for variant in args.variants:
            result = run_variant(seed, variant, args)
            base_s = base_s or result["grpo_s"]
            r = row(seed, variant, result, base_s)
            rows.append(r)
            others = ", ".join(
                f"{k} {o['change']:+.3f} ({o['sigmas']:+.1f})" for k, o in r["others"].items()
            )
            print(f"{seed:>5} {variant:<7} {r['gain']:>+7.3f} {r['se']:>6.3f}  {others:<40} "
                  f"{r['grpo_s']:>7.0f} {r['time_ratio']:>7.2f}", flush=True)  # fmt: skip
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
