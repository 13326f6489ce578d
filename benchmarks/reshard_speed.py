"""Benchmark: converting a checkpoint for a resume under another layout: time and disk against the checkpoint's size.

    python -m benchmarks.reshard_speed --size 24m --work /tmp/reshard-24m   (from the repository root)

Trains the model of `consolidate_speed.py`'s `--size` for one step on two CPU
ranks (fp32; 24m: a 24M-parameter Llama under ZeRO-2, 300m: 309M under ZeRO-3)
into `--work`, or reuses the run already there. Then, for `--rounds` rounds,
with the checkpoint's pages dropped from the page cache before each
measurement: times `cp -r` of the tag folder, and the conversion a resume on
one rank runs (`Checkpoints.latest` on rank 0: DeepSpeed's ds_to_universal,
the model-states links and the optimizer step written for every ZeRO stage,
then every converted file read back by the weights-only unpickler), each in
a fresh copy of the tag so that nothing is reused.

Printed per round, then the best round: the checkpoint's size, the disk
the universal copy adds beside it until the tag is pruned (its model-states
files are hard links to the checkpoint's, not counted), the conversion's
seconds and its throughput in checkpoint bytes per second over `cp -r`'s. A
last line is JSON with the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.consolidate_speed import SIZES, drop_cache, prepare


def size_of(folder: Path, *, added: bool = False) -> int:
    """Bytes of the files in `folder`; with `added`, only those not hard-linked elsewhere
    (the universal copy links the source tag's model-states files)."""
    files = [p.stat() for p in folder.rglob("*") if p.is_file()]
    return sum(f.st_size for f in files if not added or f.st_nlink == 1)


def convert_once(checkpoint: Path, scratch: Path) -> tuple[float, int]:
    """Seconds and bytes of one conversion of `checkpoint` (a tag folder) for a 1-rank resume."""
    from stagetrain.training.checkpoints import Checkpoints
    from stagetrain.training.integrity import read_pointer

    folder = scratch / checkpoint.parent.name
    shutil.rmtree(scratch, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(checkpoint, folder / checkpoint.name)
    shutil.copy2(checkpoint.parent / "latest.json", folder / "latest.json")
    layout = read_pointer(folder / "latest.json")["layout"]
    ckpt = Checkpoints.__new__(Checkpoints)  # the folder as given, not one named by a fingerprint
    ckpt.folder, ckpt.layout, ckpt.rank = folder, {**layout, "dp": 1}, 0
    drop_cache(folder)
    start = time.perf_counter()
    point = ckpt.latest()
    seconds = time.perf_counter() - start
    return seconds, size_of(folder / point["load_tag"], added=True)


def copy_once(checkpoint: Path, scratch: Path) -> float:
    shutil.rmtree(scratch, ignore_errors=True)
    drop_cache(checkpoint)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(checkpoint), str(scratch)], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="24m")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run = prepare(args.size, args.work)
    checkpoint = Path(run["checkpoint"])
    ckpt_bytes = size_of(checkpoint)
    rounds = []
    for i in range(args.rounds):
        copy_s = copy_once(checkpoint, args.work / "copy")
        convert_s, universal = convert_once(checkpoint, args.work / "scratch")
        rounds.append({"copy_s": copy_s, "convert_s": convert_s, "universal_bytes": universal})
        print(f"round {i + 1}: cp -r {copy_s:.2f} s, convert {convert_s:.2f} s "
              f"({convert_s / copy_s:.1f}x cp), universal copy {universal / 1e6:.1f} MB")  # fmt: skip
    best = min(rounds, key=lambda r: r["convert_s"])
    copy = min(r["copy_s"] for r in rounds)
    result = {
        "size": args.size, "params": run["params"], "zero_stage": SIZES[args.size][1],
        "checkpoint_bytes": ckpt_bytes, "universal_bytes": best["universal_bytes"],
        "convert_s": best["convert_s"], "copy_s": copy,
        "convert_MB_per_s": ckpt_bytes / best["convert_s"] / 1e6, "copy_MB_per_s": ckpt_bytes / copy / 1e6,
    }  # fmt: skip
    print(f"checkpoint {ckpt_bytes / 1e6:.1f} MB ({run['params'] / 1e6:.1f}M parameters, ZeRO-"
          f"{result['zero_stage']}, dp 2 -> 1): converted in {best['convert_s']:.2f} s "
          f"({result['convert_MB_per_s']:.0f} MB/s; cp -r {result['copy_MB_per_s']:.0f} MB/s), "
          f"universal copy {best['universal_bytes'] / 1e6:.1f} MB "
          f"({best['universal_bytes'] / ckpt_bytes:.2f}x the checkpoint)")  # fmt: skip
    shutil.rmtree(args.work / "scratch", ignore_errors=True)
    shutil.rmtree(args.work / "copy", ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
