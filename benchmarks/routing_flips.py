"""Benchmark: how often GRPO's trainer routes a sampled token to other experts than its sampler did.

    python -m benchmarks.routing_flips [--steps 20] [--pretrain-steps 60]

Run from the repository root (it imports tests.harness). For each MoE architecture
offered a tiny model (tests.harness.training's MOE and DEEPSEEK shapes) is pretrained
`--pretrain-steps` on two CPU ranks in fp32, so that its routers have learned something,
consolidated, and trained `--steps` GRPO steps from it on two ranks (ZeRO-2), once in fp32 and
once in bf16, flat rollouts. Each step the stage counts the (completion token, MoE layer) pairs
whose top-k experts differ between the sampler's KV-cached forward and the trainer's
full-sequence forward (`moe/routing_flip_share`); the summary keeps its mean and maximum, and
the mean gap between the two forwards' log-probs of the sampled tokens. Prints one row per
architecture and precision; the last line is a JSON object with them. Routing replay (verl's
R3) is worth building when the bf16 share is material: a few percent, as verl reports between
an inference engine and a trainer; here both forwards are the same model code.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pretrain-steps", type=int, default=60)
    args = parser.parse_args()
    from harness.training import (
        DEEPSEEK,
        MOE,
        dp2,
        grpo_config,
        model_config,
        prepare_data,
        run_grpo,
    )
    from harness.training import run as pretrain

    from stagetrain.config.settings import ConsolidateSettings
    from stagetrain.consolidate.folder import consolidate

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = prepare_data(root / "data")
        every = args.pretrain_steps
        for name, shape in (("mixtral", MOE), ("deepseek_v3", DEEPSEEK)):
            out = root / name
            config = model_config(out / "model", **shape)
            summary = pretrain(data, out / "pretrain", world=2, layout=dp2(2), model_config=config,
                               config_changes={"pretrain": {"steps": every, "checkpoint_every": every,
                                                            "eval_every": every}})  # fmt: skip
            (out / "summary.json").write_text(json.dumps(summary))
            consolidate(stage="pretrain", summary_path=str(out / "summary.json"),
                        tokenizer_dir=data["tokenizer"], model_config_path=config,
                        meta_path=data["meta"], out=str(out / "hf"),
                        cfg=ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss"))  # fmt: skip
            for precision in ("fp32", "bf16"):
                cfg = grpo_config(
                    steps=args.steps, eval_every=args.steps, checkpoint_every=args.steps
                )
                cfg["deepspeed"]["precision"] = precision
                began = time.monotonic()
                grpo = run_grpo({**data, "model_config": config}, str(out / "hf"),
                                out / f"grpo-{precision}", world=2, layout=dp2(2), cfg=cfg)  # fmt: skip
                sampler = grpo["sampler"]
                rows.append({
                    "architecture": name, "precision": precision,
                    "flip_share_mean": sampler["routing_flip_share_mean"],
                    "flip_share_max": sampler["routing_flip_share_max"],
                    "logprob_gap_mean": sampler["logprob_gap_mean"],
                    "seconds": round(time.monotonic() - began, 1),
                })  # fmt: skip
    print("| architecture | precision | flip share, mean | max of a step | log-prob gap, mean |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['architecture']} | {r['precision']} | {r['flip_share_mean']:.5f} | "
              f"{r['flip_share_max']:.5f} | {r['logprob_gap_mean']:.2e} |")  # fmt: skip
    print(json.dumps({"steps": args.steps, "pretrain_steps": args.pretrain_steps, "rows": rows}))


if __name__ == "__main__":
    main()
