"""The GPU check's one JSON: what the pipeline measured next to what plan.json predicted.

    python tools/gpu/report.py --run results/gpu-check-h200 --check-dir $OUT --out $OUT/report.json

Called by tools/gpu/check.sh as its last step; reads only files, so it also works on a
run that failed part-way (what is missing is listed under "missing"). Standard library
only: it must run even where the pipeline's packages did not install. Prints a short
table last, for the end of the device tool's output.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

MFU_AIM = 45.0
"""The MFU a ~1B Llama should reach on one H200 (percent of the dense bf16 peak)."""
REQUIRED = {
    "gpu": {"install", "pipeline"},
    "simulate-cpu": {"pip_resolve", "install", "hub_tests", "pipeline"},
}
"""Steps that must pass; the others (pip's checks there, versions, ds_report, the op build) are findings."""
OP_LOAD = re.compile(r"Time to load (\w+) op: ([\d.]+) seconds")


class Report:
    """Reads a run folder; every file it could not read goes to `missing` with the reason."""

    def __init__(self, run: Path) -> None:
        self.run, self.missing = run, {}

    def json(self, relative: str) -> Any:
        path = self.run / relative
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as err:
            self.missing[relative] = f"{type(err).__name__}: {err}"
            return None

    def records(self, relative: str) -> list[dict[str, Any]]:
        path = self.run / relative
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as err:
            self.missing[relative] = f"{type(err).__name__}: {err}"
            return []


def ratio(measured: float | None, predicted: float | None) -> float | None:
    return round(measured / predicted, 3) if measured and predicted else None


def steps(check_dir: Path) -> list[dict[str, Any]]:
    """check.sh's steps.tsv: name, exit status, seconds, limit."""
    path = check_dir / "steps.tsv"
    if not path.exists():
        return []
    rows = csv.reader(path.read_text().splitlines(), delimiter="\t")
    return [
        {"name": n, "rc": int(rc), "seconds": float(s), "limit_s": float(lim), "timed_out": rc in ("124", "137")}
        for n, rc, s, lim in rows
    ]  # fmt: skip


def stage_times(run: Path) -> dict[str, dict[str, float]]:
    """Snakemake's benchmark of each job: wall seconds and peak resident memory (MB)."""
    out = {}
    for tsv in sorted((run / "benchmarks").glob("*.tsv")):
        rows = list(csv.DictReader(tsv.read_text().splitlines(), delimiter="\t"))
        if rows:
            row = rows[-1]
            out[tsv.stem] = {"wall_s": float(row["s"]), "max_rss_mb": _number(row.get("max_rss"))}
    return out


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "", "NA", "-") else None
    except ValueError:
        return None


def training(report: Report, stage: str, plan: dict[str, Any] | None) -> dict[str, Any]:
    """A training stage's measured speed and memory against the plan's prediction."""
    summary = report.json(f"{stage}/summary.json") or {}
    records = report.records(f"{stage}/metrics.jsonl")
    planned = ((plan or {}).get("stages") or {}).get(stage) or {}
    memory, speed = planned.get("memory") or {}, planned.get("throughput") or {}

    def peak(key: str) -> float | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return round(max(values), 3) if values else None

    allocated, reserved = peak("memory/max_allocated(GiB)"), peak("memory/max_reserved(GiB)")
    predicted_gib = memory["total"] / 2**30 if memory.get("total") else None
    rates = [r["throughput/tokens_per_s"] for r in records[1:] if r.get("throughput/tokens_per_s")]
    out = {
        "layout": planned.get("layout"),
        "measured": {
            # GRPO's summary has no rate: its records' median (generated plus trained tokens,
            # where the plan's figure is training alone)
            "tokens_per_s": summary.get("tokens_per_s") or (sorted(rates)[len(rates) // 2] if rates else None),
            "mfu(%)": summary.get("mfu(%)"),
            "max_allocated_gib": allocated, "max_reserved_gib": reserved,
            "max_rss_gib": peak("memory/max_rss(GiB)"), "final_loss": summary.get("final_loss"),
            "records": len(records),
        },
        "planned": {
            "tokens_per_s": speed.get("tokens_per_s"),
            "mfu(%)": 100 * speed["mfu"] if speed.get("mfu") is not None else None,
            "step_s": speed.get("step_s"), "reason": speed.get("reason"),
            "memory_gib": round(predicted_gib, 3) if predicted_gib else None,
            "memory_breakdown_gib": {k: round(v / 2**30, 3) for k, v in memory.items() if isinstance(v, int) and not isinstance(v, bool)},
            "usable_gib": round(memory["usable"] / 2**30, 3) if memory.get("usable") else None,
        },
    }  # fmt: skip
    out["measured_over_planned"] = {
        "tokens_per_s": ratio(out["measured"]["tokens_per_s"], out["planned"]["tokens_per_s"]),
        "mfu": ratio(out["measured"]["mfu(%)"], out["planned"]["mfu(%)"]),
        "max_allocated": ratio(allocated, predicted_gib),
        "max_reserved": ratio(reserved, predicted_gib),
    }
    if stage == "pretrain":
        mfu = out["measured"]["mfu(%)"]
        out["mfu_aim(%)"] = MFU_AIM
        out["mfu_over_aim"] = ratio(mfu, MFU_AIM)
    else:
        out["accuracy"] = summary.get("accuracy")
    return out


def consolidated(report: Report, stage: str) -> dict[str, Any] | None:
    """model/<stage>/MANIFEST.json's verification (written only if the reload matched)."""
    manifest = report.json(f"model/{stage}/MANIFEST.json")
    if manifest is None:
        return None
    files = manifest.get("files") or {}
    return {
        "verification": manifest.get("verification"), "dtype": manifest.get("dtype"),
        "step": manifest.get("step"), "files": len(files),
        "bytes": sum(f.get("bytes", 0) for f in files.values()), "versions": manifest.get("versions"),
    }  # fmt: skip


def deepspeed_ops(run: Path, check_dir: Path) -> dict[str, Any]:
    """DeepSpeed's JIT-built ops: the load times its logs print, and check.sh's build probe."""
    loads = []
    for log in [*sorted((run / "logs").glob("*.log")), check_dir / "check.log"]:
        if log.exists():
            text = log.read_text(errors="replace")
            loads += [
                {"op": op, "seconds": float(s), "log": log.name} for op, s in OP_LOAD.findall(text)
            ]
    probe = check_dir / "op_build.json"
    return {
        "loaded_in_pipeline": loads,
        "build_probe": json.loads(probe.read_text()) if probe.exists() else None,
    }


def grpo_steps(check_dir: Path) -> dict[str, Any]:
    """benchmarks/grpo_step.py's results at ZeRO-0 and ZeRO-3 (its last line is a JSON object):
    a step's seconds, generation's, and the bare loop's."""
    out: dict[str, Any] = {}
    for zero in (0, 3):
        path = check_dir / f"grpo_step_zero{zero}.txt"
        try:
            result = json.loads(path.read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            out[f"zero{zero}"] = None
            continue
        out[f"zero{zero}"] = {
            "step_s": round(result["step_s"], 4),
            "generate_s": round(result["phases"]["generate"], 4),
            "bare_step_s": round(result["bare_step_s"], 4),
            "bare_generate_s": round(result["bare_phases"].get("generate", 0.0), 4),
            "ratio": round(result["ratio"], 3),
            "tokens_per_step": result["tokens_per_step"],
        }
    zero0, zero3 = out["zero0"], out["zero3"]
    out["zero3_over_zero0_generate"] = (
        ratio(zero3["generate_s"], zero0["generate_s"]) if zero0 and zero3 else None
    )
    return out


def tensorboard(run: Path) -> dict[str, Any]:
    """Whether the training stages wrote event files, and the logged reason where not."""
    out: dict[str, Any] = {}
    for stage in ("pretrain", "grpo"):
        events = list((run / "tensorboard" / stage).glob("events.out.tfevents.*"))
        reason = None
        log = run / "logs" / f"{stage}.log"
        if not events and log.exists():
            found = re.search(r"no TensorBoard event files.*", log.read_text(errors="replace"))
            reason = found.group(0) if found else None
        out[stage] = {"event_files": len(events), "reason": reason}
    return out


def build(run: Path, check_dir: Path, mode: str) -> dict[str, Any]:
    report = Report(run)
    plan, hardware = report.json("plan.json"), report.json("hardware.json")
    versions_path = check_dir / "versions.json"
    result = {
        "mode": mode,
        "steps": steps(check_dir),
        "versions": json.loads(versions_path.read_text()) if versions_path.exists() else None,
        "hardware": hardware,
        "plan": {k: (plan or {}).get(k) for k in ("device", "world", "precision", "model")},
        "stages": stage_times(run),
        "pretrain": training(report, "pretrain", plan),
        "grpo": training(report, "grpo", plan),
        "consolidated": {s: consolidated(report, s) for s in ("pretrain", "grpo")},
        "deepspeed_ops": deepspeed_ops(run, check_dir),
        "grpo_step": grpo_steps(check_dir),
        "tensorboard": tensorboard(run),
    }
    result["missing"] = report.missing
    passed = {s["name"] for s in result["steps"] if s["rc"] == 0}
    result["ok"] = passed >= REQUIRED[mode] and all(result["consolidated"].values())
    return result


def table(result: dict[str, Any]) -> str:
    """The few lines to read first."""
    pre = result["pretrain"]
    m, p, r = pre["measured"], pre["planned"], pre["measured_over_planned"]
    lines = [
        f"{s['name']:<22} rc {s['rc']:>3}  {s['seconds']:7.1f} s (limit {s['limit_s']:.0f})"
        for s in result["steps"]
    ]
    lines += [f"stage {name:<26} {t['wall_s']:8.1f} s" for name, t in result["stages"].items()]
    lines += [
        f"pretrain tokens/s: measured {_fmt(m['tokens_per_s'])}, planned {_fmt(p['tokens_per_s'])}, ratio {r['tokens_per_s']}",
        f"pretrain MFU %: measured {_fmt(m['mfu(%)'], 1)}, planned {_fmt(p['mfu(%)'], 1)}, aim {MFU_AIM}",
        f"pretrain peak GiB: allocated {m['max_allocated_gib']}, reserved {m['max_reserved_gib']}, planned {p['memory_gib']}",
        f"grpo step: {result['grpo_step']}",
        f"deepspeed op build: {result['deepspeed_ops']['build_probe']}",
        f"consolidated: {', '.join(f'{s}: {v is not None}' for s, v in result['consolidated'].items())}",
        f"missing: {sorted(result['missing']) or 'nothing'}",
        f"ok: {result['ok']}",
    ]  # fmt: skip
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="results/<run.name>")
    parser.add_argument("--check-dir", type=Path, required=True, help="check.sh's output folder")
    parser.add_argument("--mode", choices=("gpu", "simulate-cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = build(args.run, args.check_dir, args.mode)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    tmp.replace(args.out)
    print(table(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
