"""Held-out accuracy gains with their standard errors, shared by GRPO's summary and
`python -m stagetrain.evaluate`.

A held-out accuracy is the share of n greedy completions a verifier accepts, so
it is a binomial proportion: one standard error is sqrt(p (1 - p) / n). A gain
compares two such proportions; its standard error here is sqrt(se_a^2 + se_b^2),
which treats the two measurements as independent. Both are taken on the same
problems, and a model's answers before and after training agree more often than
chance, so the paired error is smaller: the figure reported is an upper bound,
never an understatement. The headline figure is the mean gain over families at
one level, whose error is sqrt(sum of the families' se^2) / families.

The problems are drawn with replacement from a level's held-out pool, so the se
is that of the pool's accuracy. A small pool repeats: counting level 1 has 16
held-out problems in all, so 288 draws of it hold at most 16 distinct ones. Every
entry therefore also counts its `distinct` problems; where that is far below
`problems`, the se understates how much the figure would move on other problems
of the family.

Everything here is pure arithmetic on {family: {level: (accuracy, problems, distinct)}}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypedDict

TARGET_SE = 0.03
"""The standard error an accuracy of one family and level should not exceed."""

Measured = Mapping[str, Mapping[int, tuple[float, int, int]]]
"""{family: {level: (accuracy, problems scored, distinct problems among them)}}."""


class AccuracyEntry(TypedDict):
    """One family and level: the accuracy, its standard error, the problems scored and the
    distinct problems among them."""

    accuracy: float
    se: float
    problems: int
    distinct: int


class GainEntry(TypedDict):
    """One family and level measured twice: both accuracies, the gain and its standard error."""

    start: float
    end: float
    gain: float
    se: float
    problems: int
    distinct: int


class MeanGain(TypedDict):
    """The mean gain over the chosen families measured at one level, with its standard error."""

    level: int
    families: list[str]
    gain: float
    se: float


class Drop(GainEntry):
    """A gain entry that fell, with its family and level and how many standard errors."""

    family: str
    level: int
    sigmas: float


class GainReport(TypedDict):
    """The gain report: {family: {level (text): entry}}, the mean, the largest drop."""

    by_family: dict[str, dict[str, GainEntry]]
    mean: MeanGain | None
    largest_drop: Drop | None


def standard_error(accuracy: float, problems: int) -> float:
    """One standard error of a binomial proportion measured on `problems` problems."""
    if problems < 1 or not 0.0 <= accuracy <= 1.0:
        raise ValueError(
            f"need an accuracy in [0, 1] on >= 1 problem, not {accuracy} on {problems}"
        )
    return math.sqrt(accuracy * (1.0 - accuracy) / problems)


def problems_for(se: float = TARGET_SE) -> int:
    """Problems per family and level that keep one standard error <= `se` at any accuracy
    (the worst case is p = 0.5: 278 for 0.03)."""
    return math.ceil(0.25 / se**2)


def accuracy_entry(accuracy: float, problems: int, distinct: int) -> AccuracyEntry:
    """{accuracy, se, problems, distinct} of one family and level."""
    se = standard_error(accuracy, problems)
    return AccuracyEntry(accuracy=accuracy, se=se, problems=problems, distinct=distinct)


def gain_entry(start: tuple[float, int, int], end: tuple[float, int, int]) -> GainEntry:
    """{start, end, gain, se, problems, distinct} of one family and level, from two
    (accuracy, problems, distinct)."""
    se = math.hypot(standard_error(*start[:2]), standard_error(*end[:2]))
    return GainEntry(start=start[0], end=end[0], gain=end[0] - start[0], se=se,
                     problems=min(start[1], end[1]), distinct=min(start[2], end[2]))  # fmt: skip


def gains(
    start: Measured, end: Measured, level: int = 1, families: Sequence[str] | None = None
) -> GainReport:
    """The gain report: `by_family` ({family: {level: gain_entry}} for every family and level
    both measured), `mean` (the mean gain over `families`, default all, measured at `level`,
    with its standard error; null when none was) and `largest_drop` (the entry that fell by
    the most standard errors, with its family, level and `sigmas`; null when none fell), which
    shows what training one skill cost another."""
    by_family = {
        family: {
            str(lv): gain_entry(start[family][lv], end[family][lv])
            for lv in sorted(start[family])
            if lv in end.get(family, {})
        }
        for family in start
        if family in end
    }
    chosen = {f: lv for f, lv in by_family.items() if families is None or f in families}
    at_level = [levels[str(level)] for levels in chosen.values() if str(level) in levels]
    mean = None
    if at_level:
        mean = MeanGain(
            level=level,
            families=[f for f, levels in chosen.items() if str(level) in levels],
            gain=sum(e["gain"] for e in at_level) / len(at_level),
            se=math.sqrt(sum(e["se"] ** 2 for e in at_level)) / len(at_level),
        )
    drops = [
        Drop(**e, family=f, level=int(lv), sigmas=-e["gain"] / e["se"] if e["se"] else math.inf)
        for f, levels in by_family.items() for lv, e in levels.items() if e["gain"] < 0
    ]  # fmt: skip
    largest = max(drops, key=lambda d: d["sigmas"], default=None)
    return GainReport(by_family=by_family, mean=mean, largest_drop=largest)
