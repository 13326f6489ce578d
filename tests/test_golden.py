"""Golden losses: ten fp32 optimizer steps of the tiny model on one rank, each step's loss pinned.

A change to the maths the pretrain stage runs (the model and its initialisation,
the data order, the loss, the optimizer and its schedule, DeepSpeed's step) or to
the data it reads (the generated corpus, the tokenizer) moves these numbers, so it
is noticed. A change meant to leave the maths alone passes as it is; one meant to
alter them updates GOLDEN from the failure message and says why in its commit.

Measured stable far inside RTOL: two runs, one and two torch threads, gave the
same bits; ATEN_CPU_CAPABILITY=avx2 against this machine's default (AVX-512)
moved single losses by at most 2e-7 relative. The harness runs the rank on one
thread (OMP_NUM_THREADS=1), so the thread count is fixed in any case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.training import run

pytestmark = pytest.mark.slow
RTOL = 1e-5
STEPS = 10
GOLDEN = [
    6.1985764503479, 6.256595134735107, 6.238207817077637, 6.0333099365234375, 5.723306655883789,
    5.578721046447754, 5.385593414306641, 5.119020938873291, 5.276350021362305, 4.9812211990356445,
]  # fmt: skip


def test_ten_fp32_steps_give_the_golden_losses(data: dict[str, str], tmp_path: Path) -> None:
    summary = run(data, tmp_path, world=1, layout={"dp": 1, "tp": 1, "micro_batch_size": 4, "zero_stage": 0},
                  config_changes={"pretrain": {"steps": STEPS, "eval_every": STEPS, "checkpoint_every": STEPS}})  # fmt: skip
    losses = [summary["losses"][str(step)] for step in range(1, STEPS + 1)]
    assert losses == pytest.approx(GOLDEN, rel=RTOL), f"losses now: {losses}"
