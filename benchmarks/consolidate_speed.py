"""Benchmark: consolidation against a plain `cp -r` of the checkpoint: throughput, peak memory, disk reads.

    python -m benchmarks.consolidate_speed --size 24m  --work /tmp/consolidate-24m
    python -m benchmarks.consolidate_speed --size 300m --work /tmp/consolidate-300m

(from the repository root: it imports tests.harness)

Trains the model for one step on two CPU ranks (fp32, so the checkpoint holds
fp32 partitions beside both Adam moments; 24m: a 24M-parameter Llama under
ZeRO-2, 300m: a 309M-parameter Llama under ZeRO-3, 3.7 GB of checkpoint)
into `--work`, or reuses the run already there. Then, for `--rounds` rounds,
interleaved so that the shared machine's load falls on both alike: drops the
checkpoint's pages from the page cache (sync, then posix_fadvise DONTNEED on
every file), times `cp -r` of the checkpoint folder; drops them again and runs
the consolidate stage in a fresh process (bf16, 20 MB shards, verification by
the validation loss). Between measurements `sync` writes the last one's output
out, untimed.

Printed per round, then the best round's speeds and the worst round's memory
and reads: the conversion's throughput in
checkpoint bytes per second (read, assemble, write the shards: up to the
stage's "convert" phase) over `cp -r`'s; the verification's and the manifest's
seconds; the conversion's peak RSS above a process that only imports the same
libraries (VmHWM; reset with /proc/self/clear_refs before the verification,
whose own peak is printed per parameter); bytes read from disk during the
conversion (/proc/self/io read_bytes, with the cache dropped) and bytes asked
of the kernel (rchar), each over the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    "24m": ({"hidden_size": 512, "intermediate_size": 1408, "num_layers": 8, "num_heads": 8,
             "num_kv_heads": 4}, 2),
    "300m": ({"hidden_size": 1024, "intermediate_size": 2816, "num_layers": 24, "num_heads": 16,
              "num_kv_heads": 16}, 3),
}  # fmt: skip
"""Model shape and ZeRO stage of each benchmark checkpoint."""

IMPORTS = """
import json, re, sys
import deepspeed, numpy, safetensors, torch, transformers
import transformers.models.llama.modeling_llama
import stagetrain.consolidate.folder
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
"""
BASELINE = IMPORTS + "print(json.dumps({'hwm': status('VmHWM')}))"
CONSOLIDATE = (
    IMPORTS
    + """
import time
from stagetrain.consolidate.folder import consolidate
from stagetrain.config.settings import ConsolidateSettings
def io():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return {k: int(fields[k]) for k in ("read_bytes", "rchar")}
a = json.loads(sys.argv[1])
marks = {}
def on_phase(name):
    marks[name] = {"t": time.perf_counter(), "hwm": status("VmHWM"), **io()}
    open("/proc/self/clear_refs", "w").write("5")  # the next phase's peak starts from here
on_phase("start")
consolidate(stage="pretrain", summary_path=a["summary"], tokenizer_dir=a["tokenizer"], model_config_path=a["model_config"],
            meta_path=a["meta"], out=a["out"], cfg=ConsolidateSettings(dtype="bf16", max_shard_size="20MB", verify="loss"),
            on_phase=on_phase)
print(json.dumps(marks))
"""
)


def prepare(size: str, work: Path) -> dict[str, str]:
    """The run's inputs for the stage, training the checkpoint first unless `work` has it."""
    spec = work / "spec.json"
    if spec.exists():
        return json.loads(spec.read_text())
    from tests.harness import training as harness

    shape, zero = SIZES[size]
    data = harness.prepare_data(work / "data")
    config = harness.model_config(work / "model_config", tie_word_embeddings=False, **shape)
    start = time.perf_counter()
    summary = harness.run(data, work / "run", world=2, model_config=config,
                          layout={"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": zero},
                          config_changes={"pretrain": {"steps": 1, "eval_every": 1, "checkpoint_every": 1}})  # fmt: skip
    print(f"trained one step in {time.perf_counter() - start:.0f} s")
    (work / "summary.json").write_text(json.dumps(summary))
    args = {**data, "model_config": config, "summary": str(work / "summary.json"),
            "params": summary["param_elements"],
            "checkpoint": str(Path(summary["checkpoint"]["folder"]) / summary["checkpoint"]["tag"])}  # fmt: skip
    spec.write_text(json.dumps(args))
    return args


def drop_cache(folder: Path) -> None:
    """Write dirty pages out, then ask the kernel to forget the folder's cached pages."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def python(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_round(args: dict, work: Path, ckpt_bytes: int) -> dict[str, float]:
    """cp -r, then the stage, each from a cold page cache; the round's figures."""
    checkpoint, copy, out = Path(args["checkpoint"]), work / "copy", work / "model"
    shutil.rmtree(copy, ignore_errors=True)
    drop_cache(checkpoint)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(checkpoint), str(copy)], check=True)
    cp_s = time.perf_counter() - start
    shutil.rmtree(copy)
    shutil.rmtree(out, ignore_errors=True)
    drop_cache(checkpoint)
    m = python(CONSOLIDATE, json.dumps({**args, "out": str(out)}))
    shards = sorted(out.glob("*.safetensors"))
    convert_s = m["convert"]["t"] - m["start"]["t"]
    return {
        "cp_gbps": ckpt_bytes / cp_s / 1e9,
        "convert_gbps": ckpt_bytes / convert_s / 1e9,
        "convert_s": convert_s,
        "verify_s": m["verify"]["t"] - m["convert"]["t"],
        "describe_s": m["describe"]["t"] - m["verify"]["t"],
        "convert_hwm": m["convert"]["hwm"],
        "verify_hwm": m["verify"]["hwm"],
        "read_bytes": m["convert"]["read_bytes"] - m["start"]["read_bytes"],
        "rchar": m["convert"]["rchar"] - m["start"]["rchar"],
        "largest_shard": max(f.stat().st_size for f in shards),
        "shards": len(shards),
        "written": sum(f.stat().st_size for f in shards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="24m")
    parser.add_argument(
        "--work", type=Path, required=True, help="folder of the run (reused if there)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    cli = parser.parse_args()
    cli.work.mkdir(parents=True, exist_ok=True)
    args = prepare(cli.size, cli.work)
    checkpoint = Path(args["checkpoint"])
    ckpt_bytes = sum(f.stat().st_size for f in checkpoint.iterdir())
    optim = sum(f.stat().st_size for f in checkpoint.glob("*optim_states.pt"))
    baseline = min(python(BASELINE)["hwm"] for _ in range(3))
    print(f"{args['params']:,} parameters; checkpoint {ckpt_bytes / 1e6:,.0f} MB "
          f"({optim / 1e6:,.0f} MB of it optimizer files); baseline (imports only) {baseline / 1e6:.0f} MB")  # fmt: skip
    rounds = []
    for i in range(cli.rounds):
        r = one_round(args, cli.work, ckpt_bytes)
        rounds.append(r)
        print(f"round {i + 1}: cp -r {r['cp_gbps']:.3f} GB/s, convert {r['convert_gbps']:.3f} GB/s "
              f"(ratio {r['convert_gbps'] / r['cp_gbps']:.2f}; {r['convert_s']:.1f} s), verify {r['verify_s']:.1f} s, "
              f"manifest {r['describe_s']:.1f} s; peak +{(r['convert_hwm'] - baseline) / 1e6:.0f} MB converting, "
              f"+{(r['verify_hwm'] - baseline) / 1e6:.0f} MB verifying; "
              f"read from disk {r['read_bytes'] / 1e6:,.0f} MB", flush=True)  # fmt: skip
    best_cp, best = max(r["cp_gbps"] for r in rounds), max(rounds, key=lambda r: r["convert_gbps"])
    above = max(r["convert_hwm"] for r in rounds) - baseline  # memory and reads: the worst round
    verify_above = max(r["verify_hwm"] for r in rounds) - baseline
    read, rchar = max(r["read_bytes"] for r in rounds), max(r["rchar"] for r in rounds)
    print(f"{best['written'] / 1e6:.0f} MB of bf16 safetensors in {best['shards']} shards, largest {best['largest_shard'] / 1e6:.1f} MB")  # fmt: skip
    print(f"best of {cli.rounds}: cp -r {best_cp:.3f} GB/s, conversion {best['convert_gbps']:.3f} GB/s of checkpoint: "
          f"ratio {best['convert_gbps'] / best_cp:.2f} (target >= 0.5)")  # fmt: skip
    print(f"verification {min(r['verify_s'] for r in rounds):.1f} s, manifest {min(r['describe_s'] for r in rounds):.1f} s")  # fmt: skip
    print(f"conversion peak RSS above baseline: {above / 1e6:.1f} MB = {above / best['largest_shard']:.2f}x "
          f"the largest shard (target <= 1.5)")  # fmt: skip
    print(f"verification peak RSS above baseline: {verify_above / 1e6:.0f} MB = "
          f"{verify_above / args['params']:.2f} bytes per parameter")  # fmt: skip
    print(f"read from disk during the conversion: {read / 1e6:,.0f} MB = {read / ckpt_bytes:.1%} of the checkpoint "
          f"(target <= 40%); asked of the kernel (rchar): {rchar / 1e6:,.0f} MB = {rchar / ckpt_bytes:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
