"""Benchmark: consolidation throughput next to a plain copy of the same bytes, and peak memory.

    python benchmarks/consolidate_speed.py

Trains a 26M-parameter Llama for one step on two CPU ranks (ZeRO-2, fp32, so
the checkpoint holds fp32 partitions), then, each in a fresh process:
consolidates it to bf16 safetensors in 20 MB shards (the whole stage, reload
and loss check included), and copies the written shards with shutil. Prints
GB/s of both and their ratio, and the consolidating process's peak resident
memory next to the largest shard and the fp32 checkpoint size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CONSOLIDATE = """
import json, resource, sys, time
from stagetrain.consolidate.folder import consolidate
a = json.loads(sys.argv[1])
start = time.perf_counter()
consolidate(stage="pretrain", summary_path=a["summary"], tokenizer_dir=a["tokenizer"], model_config_path=a["model_config"],
            meta_path=a["meta"], out=a["out"], cfg={"dtype": "bf16", "max_shard_size": "20MB"})
print(json.dumps({"seconds": time.perf_counter() - start, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
COPY = """
import json, shutil, sys, time
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
start = time.perf_counter()
for f in sorted(src.glob("*.safetensors")):
    shutil.copyfile(f, dst / f.name)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def main() -> None:
    import pretrain_harness as harness

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = harness.prepare_data(out / "data")
        config = harness.model_config(out / "big", hidden_size=512, intermediate_size=1408, num_layers=8,
                                      num_heads=8, num_kv_heads=4, tie_word_embeddings=False)  # fmt: skip
        summary = harness.run(data, out / "run", world=2, model_config=config,
                              layout={"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 2},
                              config_changes={"pretrain": {"steps": 1, "eval_every": 1, "checkpoint_every": 1}})  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary))
        ckpt = Path(summary["checkpoint"]["folder"]) / summary["checkpoint"]["tag"]
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
        args = {
            **data,
            "model_config": config,
            "summary": str(out / "summary.json"),
            "out": str(out / "model"),
        }
        run = subprocess.run(
            [sys.executable, "-c", CONSOLIDATE, json.dumps(args)],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(run.stdout.strip().splitlines()[-1])
        shards = sorted((out / "model").glob("*.safetensors"))
        written = sum(f.stat().st_size for f in shards)
        copy = subprocess.run([sys.executable, "-c", COPY, str(out / "model"), str(out / "copy")],
                              capture_output=True, text=True, check=True)  # fmt: skip
        copy_s = json.loads(copy.stdout.strip().splitlines()[-1])["seconds"]
        ours, plain = written / result["seconds"] / 1e9, written / copy_s / 1e9
        print(f"{summary['param_elements']:,} parameters; fp32 checkpoint {ckpt_bytes / 1e6:.0f} MB; "
              f"{written / 1e6:.0f} MB of bf16 safetensors in {len(shards)} shards")  # fmt: skip
        print(f"consolidate (whole stage, verification included): {ours:.3f} GB/s")
        print(f"plain copy of the same bytes:                     {plain:.3f} GB/s")
        print(f"ratio: {ours / plain:.3f}")
        largest = max(f.stat().st_size for f in shards)
        print(f"peak RSS {result['rss'] / 1e6:.0f} MB; largest shard {largest / 1e6:.0f} MB; "
              f"fp32 checkpoint {ckpt_bytes / 1e6:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
