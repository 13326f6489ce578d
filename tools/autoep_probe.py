"""Probe: does DeepSpeed's AutoEP (expert parallelism) train this environment's MoE models?

    python tools/autoep_probe.py

For the tests' tiny Mixtral, Qwen2-MoE and DeepSeek-V3 (`tests/harness/models.py:tiny_moe`; DeepSeek's
routing bias random, so that it moves the choice), 5 AdamW steps on 2 CPU ranks (gloo) with AutoEP
at ep=2 (ZeRO-1), and the same steps on 1 rank without it, on the same global batch; prints
both loss curves, their largest relative difference, and whether AutoEP replaced the MoE
blocks; exits non-zero unless every model passes (`python tools/autoep_probe.py qwen2_moe` probes one). The planner's `ep` axis offers the architectures
that pass here (`model.architectures.EXPERT_PARALLEL`). `deepspeed.initialize` runs inside
`training.autoep.keyed_output_registry`, as the training engine's does: AutoEP retargets
Mixtral's router-logit recorder in transformers' output-capture registry as if it were a plain
dict, which it was up to transformers 5.22, and without the lent registry Mixtral fails on 5.25
(`_CanRecordRegistry.get() takes 2 positional arguments but 3 were given`), and Qwen2-MoE with it
(the same adapter). With DeepSpeed 0.19.8 (2026-12-04) all three pass on transformers 5.17 and
5.25 (2 ranks match 1 to 1e-7).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]  # harness.models: the tiny MoE models the tests use
STEPS, BATCH, LENGTH = 5, 8, 16


def rank(architecture: str, ep: int, out: str) -> None:
    """One rank's run: the model seeded alike on every rank, its share of each global batch."""
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    world, me = dist.get_world_size(), dist.get_rank()
    from harness.models import tiny_moe

    model = tiny_moe(architecture).train()  # seeded: the same weights on every rank
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}  # fmt: skip
    if ep > 1:
        # No preset_model: AutoEP finds the preset from the model's model_type, as the stage's
        # rendered config leaves it to (qwen2_moe's is qwen3_moe's).
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "use_grouped_mm": False}
    from stagetrain.training.autoep import keyed_output_registry

    with keyed_output_registry():
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, model.config.vocab_size, (BATCH, LENGTH), generator=batches)
        mine = batch.chunk(world)[me]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if me == 0:
        replaced = any(type(m).__name__ == "AutoEPMoELayer" for m in engine.module.modules())
        Path(out).write_text(json.dumps({"losses": losses, "replaced": replaced}))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--rank":
        rank(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    import deepspeed
    import transformers

    print(f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for architecture in sys.argv[1:] or ("mixtral", "qwen2_moe", "deepseek_v3"):
            runs = {}
            for ep in (2, 1):
                out = Path(tmp) / f"{architecture}-{ep}.json"
                proc = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                     str(ep), __file__, "--rank", architecture, str(ep), str(out)],
                    capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                if proc.returncode or not out.is_file():
                    error = re.findall(r"^\[rank0\]: (\w+Error: .*)$", proc.stderr, flags=re.M)
                    print(
                        f"{architecture} ep={ep}: failed: {error[0] if error else f'exit {proc.returncode}: {proc.stderr.strip()[-300:]}'}"
                    )
                    break
                runs[ep] = json.loads(out.read_text())
            if len(runs) < 2:
                ok = False
                continue
            gap = max(
                abs(a - b) / abs(b)
                for a, b in zip(runs[2]["losses"], runs[1]["losses"], strict=True)
            )
            same = gap < 1e-4 and runs[2]["replaced"]
            ok &= same
            print(f"{architecture}: ep=2 {runs[2]['losses']}\n{architecture}: ep=1 {runs[1]['losses']}\n"
                  f"{architecture}: AutoEP layers {runs[2]['replaced']}, largest relative gap {gap:.1e}")  # fmt: skip
    print("AutoEP: usable here" if ok else "AutoEP: not usable here")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
