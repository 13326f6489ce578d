"""The attention kernel the training stages run: what `deepspeed.attention` asks for, decided by
what the hardware measured.

transformers runs a model's attention through torch's fused `scaled_dot_product_attention`
("sdpa") by default, or as a plain product, softmax and product ("eager"). On GPUs the fused
kernels win and `auto` keeps sdpa. On a CPU the answer depends on the CPU and the precision:
hardware.json times both (`hardware.speed.attention_ms`), and `auto` takes eager only where it
is clearly faster (EAGER_MIN_SPEEDUP), so that a noisy measurement does not flip the plan (and
rerun the stages) between two detections of one machine. Both compute the same attention; the
choice changes the speed, and the rounding in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrain.hardware.report import SpeedReport
from stagetrain.planning.plan import Attention

EAGER_MIN_SPEEDUP = 1.2


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The kernel and the reason in words (with the numbers), for plan.json."""

    attention: Attention
    reason: str


def choose(requested: str, *, gpu: bool, speed: SpeedReport | None, precision: str) -> Choice:
    """The attention kernel for a plan in `precision`.

    Args:
        requested: `deepspeed.attention` (auto, sdpa, eager).
        gpu: whether the ranks are GPUs.
        speed: hardware.json's `speed` (None for described hardware).
        precision: the plan's training precision.
    """
    if requested != "auto":
        return Choice(attention=requested, reason="requested")  # type: ignore[arg-type]
    if gpu:
        return Choice(attention="sdpa", reason="auto: GPUs run torch's fused attention kernels")
    measured = speed.get("attention_ms", {}).get(precision) if speed else None
    if not measured:
        return Choice(
            attention="sdpa", reason=f"auto: no {precision} attention timing in hardware.json"
        )
    ratio = measured["sdpa"] / measured["eager"]
    pick: Attention = "eager" if ratio >= EAGER_MIN_SPEEDUP else "sdpa"
    return Choice(
        attention=pick,
        reason=f"auto: {precision} attention forward and backward measured {measured['sdpa']:.2f} ms "
        f"(sdpa) against {measured['eager']:.2f} ms (eager), eager {ratio:.2f}x; "
        f"eager needs >= {EAGER_MIN_SPEEDUP}x",
    )
