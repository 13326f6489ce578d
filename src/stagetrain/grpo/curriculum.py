"""The difficulty curriculum, one per task family: which level each family's prompts come
from, moved by that family's rolling success rate.

GRPO learns nothing from a group whose completions all succeed or all fail
(zero advantage), so prompts should be hard enough to fail sometimes and easy
enough to succeed sometimes. What is hard differs by family (the tiny default
model almost never answers arithmetic level 1 and often answers comparison
level 1), so one level for all families would be decided on a rate that sits
between them and fits neither. Each family therefore has its own `CurriculumState`, with the same
config: it keeps the success rate of the family's last `window` current-level
prompts (a reward >= 1 is a success) and, once the model has spent `min_steps`
optimizer steps at the level and the window is full:

    promote (level + 1) when rate >= promote_at    and level < top_level(cfg, family)
    demote  (level - 1) when rate <= demote_below  and level > 1

where `top_level` is the lower of `max_level` and the family's own highest
level. A change empties the window and the step count, so the next decision is
made on outcomes of the new level only. Demotion may go below start_level, down
to 1: a start that proves too hard is corrected rather than stuck. Every family
ages by one step each step, whether or not it drew a prompt, so `min_steps`
counts training time, not luck of the draw.

Each prompt's family is drawn uniformly, then its level from that family's
state: a share `earlier_share` uniformly from levels 1 .. level - 1 (to keep
earlier skills), the rest at the current level. Only current-level outcomes
feed a family's window.

Everything here is deterministic given its inputs (the sampler takes the rng),
and the state round-trips through JSON because it is saved with checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from stagetrain.config.settings import CurriculumSettings
from stagetrain.errors import StageError
from stagetrain.tasks.registry import get_family

KEY = "grpo.curriculum"

CurriculumEvent = TypedDict(
    "CurriculumEvent",
    {
        "step": int,
        "family": str,
        "kind": Literal["promote", "demote"],
        "from": int,
        "to": int,
        "success_rate": float,
        "window": int,
    },
)
"""One promotion or demotion (`update`): in the state's `events`, the metrics' `curriculum/events`."""


class CurriculumStateRecord(TypedDict):
    """`CurriculumState` as a checkpoint and summary.json store it (`to_json`)."""

    family: str
    level: int
    steps_at_level: int
    recent: list[int]
    events: list[CurriculumEvent]


def top_level(cfg: CurriculumSettings, family: str) -> int:
    """The highest level a family can reach: max_level, or the family's own top if lower."""
    return min(cfg.max_level, get_family(family).max_level)


@dataclass(kw_only=True, slots=True)
class CurriculumState:
    """Where one family's curriculum stands; mutated by `update`, saved with checkpoints."""

    family: str
    level: int
    steps_at_level: int = 0
    recent: list[int] = field(default_factory=list)
    """0/1 outcomes of the family's latest current-level prompts, oldest first, at most `window`."""
    events: list[CurriculumEvent] = field(default_factory=list)
    """Every promotion and demotion of this family so far, as `update` returned them."""

    @classmethod
    def start(cls, cfg: CurriculumSettings, family: str) -> CurriculumState:
        """The family's state before the first step (start_level, or its top level if lower)."""
        return cls(family=family, level=min(cfg.start_level, top_level(cfg, family)))

    def to_json(self) -> CurriculumStateRecord:
        """The state as a checkpoint stores it."""
        return CurriculumStateRecord(
            family=self.family,
            level=self.level,
            steps_at_level=self.steps_at_level,
            recent=list(self.recent),
            events=[CurriculumEvent(**e) for e in self.events],
        )

    @classmethod
    def from_json(cls, data: CurriculumStateRecord) -> CurriculumState:
        """The state `to_json` wrote."""
        return cls(
            family=str(data["family"]),
            level=int(data["level"]),
            steps_at_level=int(data["steps_at_level"]),
            recent=[int(x) for x in data["recent"]],
            events=[CurriculumEvent(**e) for e in data["events"]],
        )


def update(
    state: CurriculumState, cfg: CurriculumSettings, step: int, outcomes: Sequence[float]
) -> CurriculumEvent | None:
    """Record one optimizer step's current-level rewards of the family; promote or demote if due.

    Returns the event {"step", "family", "kind": "promote" | "demote", "from", "to",
    "success_rate", "window"} (also appended to state.events), or None.
    """
    state.recent.extend(1 if r >= 1 else 0 for r in outcomes)
    del state.recent[: -cfg.window]
    state.steps_at_level += 1
    if state.steps_at_level < cfg.min_steps or len(state.recent) < cfg.window:
        return None
    rate = sum(state.recent) / len(state.recent)
    kind: Literal["promote", "demote"]
    if rate >= cfg.promote_at and state.level < top_level(cfg, state.family):
        kind, to = "promote", state.level + 1
    elif rate <= cfg.demote_below and state.level > 1:
        kind, to = "demote", state.level - 1
    else:
        return None
    event: CurriculumEvent = {
        "step": step,
        "family": state.family,
        "kind": kind,
        "from": state.level,
        "to": to,
        "success_rate": rate,
        "window": len(state.recent),
    }
    state.level, state.steps_at_level, state.recent = to, 0, []
    state.events.append(event)
    return event


def window_rate(state: CurriculumState) -> float | None:
    """Success rate over the family's window, None while it is empty."""
    return sum(state.recent) / len(state.recent) if state.recent else None


def levels_for(
    state: CurriculumState, cfg: CurriculumSettings, n: int, rng: random.Random
) -> list[int]:
    """The level of each of n prompts of the family: uniform over 1 .. level - 1 with
    probability earlier_share, else the current level (always the current level at level 1)."""
    if state.level == 1:
        return [1] * n
    return [
        rng.randint(1, state.level - 1) if rng.random() < cfg.earlier_share else state.level
        for _ in range(n)
    ]


@dataclass(kw_only=True, slots=True)
class Curriculum:
    """Every family's state, by family name in sorted order.

    Sorted so that draws do not depend on the order of the config list or of a
    stored dict: a resumed run draws exactly what an uninterrupted one would.
    """

    states: dict[str, CurriculumState]

    @classmethod
    def start(cls, cfg: CurriculumSettings, families: Sequence[str]) -> Curriculum:
        """The states before the first step; unknown or repeated families are refused."""
        if len(set(families)) != len(families):
            raise StageError(f"{KEY}.families: a family is listed twice ({list(families)})")
        return cls(states={f: CurriculumState.start(cfg, f) for f in sorted(families)})

    def to_json(self) -> dict[str, CurriculumStateRecord]:
        """{family: state} as a checkpoint and summary.json store it."""
        return {f: s.to_json() for f, s in self.states.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, CurriculumStateRecord]) -> Curriculum:
        """The curriculum `to_json` wrote."""
        return cls(states={f: CurriculumState.from_json(data[f]) for f in sorted(data)})

    def levels(self) -> dict[str, int]:
        """{family: current level}."""
        return {f: s.level for f, s in self.states.items()}


def draw(
    curriculum: Curriculum, cfg: CurriculumSettings, n: int, rng: random.Random
) -> list[tuple[str, int]]:
    """(family, level) of each of n prompts: the family uniform over the curriculum's
    families, then the level as `levels_for` draws it for that family, never above the
    family's top level."""
    families = list(curriculum.states)
    out = []
    for _ in range(n):
        family = rng.choice(families)
        (level,) = levels_for(curriculum.states[family], cfg, 1, rng)
        out.append((family, min(level, top_level(cfg, family))))
    return out


def update_all(
    curriculum: Curriculum,
    cfg: CurriculumSettings,
    step: int,
    outcomes: Iterable[tuple[str, int, float]],
) -> list[CurriculumEvent]:
    """Record one optimizer step for every family; the events it caused, in family order.

    `outcomes` holds (family, level, outcome) of each prompt of the step, the outcome
    as `update` takes it (>= 1 is a success); a family's window gets only the outcomes
    of its prompts at its current level (outcomes of families outside the curriculum, the
    replayed ones, are left out). Every family is updated, so one that drew no prompt still
    ages by a step.
    """
    by_family: dict[str, list[float]] = {f: [] for f in curriculum.states}
    for family, level, outcome in outcomes:
        if family in by_family and level == curriculum.states[family].level:  # not a replay
            by_family[family].append(outcome)
    events = [update(s, cfg, step, by_family[f]) for f, s in curriculum.states.items()]
    return [e for e in events if e is not None]
