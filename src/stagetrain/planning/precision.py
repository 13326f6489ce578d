"""The training precision: what `deepspeed.precision` asks for, decided by what the hardware measured.

`auto` on a CPU trains in bf16 only where hardware.json's matrix-product
benchmark shows bf16 clearly faster than fp32 (BF16_MIN_SPEEDUP), else in fp32:
a CPU without native bf16 emulates it, many times slower, and fp32 never is.
fp16 is not an `auto` choice on CPUs (no CPU here ran it natively, and it needs
loss scaling). On GPUs `auto` is bf16 where the catalog says the card has it,
else fp16 with dynamic loss scaling. An explicit choice is honoured; when the
measurement says it is slower than fp32, the plan carries a warning with the
expected slowdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stagetrain.errors import StageError
from stagetrain.hardware.catalog import GpuSpec
from stagetrain.hardware.report import SpeedReport
from stagetrain.planning.plan import Precision

BF16_MIN_SPEEDUP = 1.2
"""bf16 must beat fp32 by this factor on a CPU: below it the gain does not pay for
bf16's coarser rounding of small updates."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The precision, the reason in words (with the numbers), and warnings for plan.json."""

    precision: Precision
    reason: str
    warnings: tuple[str, ...] = ()


def _rates(speed: SpeedReport | None) -> dict[str, float] | None:
    return speed.get("gflops") if speed else None


def _measured(rates: Mapping[str, float], speed: SpeedReport | None) -> str:
    assert speed is not None, "rates are read from a speed report"
    where = f"{speed['threads']} thread(s)" if speed.get("threads") else speed["device"]
    cap = f", {speed['capability']}" if speed.get("capability") else ""
    listing = ", ".join(f"{k} {v:,.1f}" for k, v in rates.items())
    return f"measured GFLOP/s ({where}{cap}): {listing}"


def choose(requested: str, gpu: GpuSpec | None, speed: SpeedReport | None) -> Choice:
    """The precision to train in.

    Args:
        requested: `deepspeed.precision` (auto, bf16, fp16, fp32).
        gpu: the catalog entry of the GPUs, None on CPU ranks.
        speed: hardware.json's `speed` (None for described hardware).

    Raises:
        StageError: bf16 requested on a GPU without bf16.
    """
    rates = _rates(speed)
    if gpu is not None:
        if requested == "bf16" and not gpu.bf16:
            raise StageError(
                f"deepspeed.precision: bf16 requested but {gpu.key} has no bf16 support"
            )
        measured = f"; {_measured(rates, speed)}" if rates else ""
        if requested == "auto":
            pick: Precision = "bf16" if gpu.bf16 else "fp16"
            why = "has bf16" if gpu.bf16 else "has no bf16: fp16 with loss scaling"
            return Choice(precision=pick, reason=f"auto: the {gpu.key} {why} (catalog){measured}")
        return Choice(precision=requested, reason=f"requested{measured}")  # type: ignore[arg-type]
    if requested == "auto":
        if not rates:
            return Choice(
                precision="fp32",
                reason="auto: no measured speed in hardware.json, and fp32 is never emulated on a CPU",
            )
        ratio = rates["bf16"] / rates["fp32"]
        pick = "bf16" if ratio >= BF16_MIN_SPEEDUP else "fp32"
        return Choice(
            precision=pick,
            reason=f"auto: bf16 runs {ratio:.2f}x fp32 here (bf16 needs {BF16_MIN_SPEEDUP}x); "
            + _measured(rates, speed),
        )
    warnings: tuple[str, ...] = ()
    if rates and requested != "fp32" and rates[requested] < rates["fp32"]:
        slower = rates["fp32"] / rates[requested]
        warnings = (
            f"deepspeed.precision: {requested} requested, but this CPU runs {requested} matrix "
            f"products {slower:.1f}x slower than fp32 ({rates[requested]:,.1f} vs "
            f"{rates['fp32']:,.1f} GFLOP/s): expect training up to that much slower; "
            "'auto' would choose fp32",
        )
    reason = "requested" + (f"; {_measured(rates, speed)}" if rates else "")
    return Choice(precision=requested, reason=reason, warnings=warnings)  # type: ignore[arg-type]
