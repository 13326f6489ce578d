"""The tolerances and comparisons of the distributed proofs: two runs that must train alike."""

from __future__ import annotations

from typing import Any

import pytest

from .training import final_params

LOSS_RTOL = 1e-4
"""Losses of two layouts of the same fp32 run agree to this, relative (summation order differs)."""
PARAM_ATOL = 1e-4
"""Their final parameters to this, absolute."""


def losses(summary: dict[str, Any]) -> list[float]:
    """The four steps' training losses of a harness run."""
    return [summary["losses"][str(step)] for step in range(1, 5)]


def same_losses(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert the two runs' losses agree to LOSS_RTOL."""
    assert losses(a) == pytest.approx(losses(b), rel=LOSS_RTOL)


def same_params(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert the two runs' final parameters agree to PARAM_ATOL."""
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    worst = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    assert worst < PARAM_ATOL, worst
