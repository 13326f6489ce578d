"""The task families by name, and reproducible draws of problems from one split.

A draw for a split is rejection sampling: generate, keep the problem if its key
hashes to that split. Each level of each family has hundreds of problems or
more, so a split is reached in a few dozen tries and the bound is only a guard.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagetrain.errors import StageError
from stagetrain.tasks import arithmetic, text
from stagetrain.tasks.problem import SPLITS, Problem, Split, check_level, split_of

MAX_TRIES = 2000


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """A generator of problems at difficulty levels 1..max_level."""

    name: str
    max_level: int
    generate: Callable[[random.Random, int], Problem]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name=arithmetic.FAMILY, max_level=arithmetic.MAX_LEVEL, generate=arithmetic.generate
        ),
        Family(name="counting", max_level=text.MAX_LEVEL, generate=text.counting),
        Family(name="comparison", max_level=text.MAX_LEVEL, generate=text.comparison),
    )
}


def get_family(name: str) -> Family:
    """The family of that name, or a StageError listing the known ones."""
    if name not in FAMILIES:
        raise StageError(f"tasks: unknown family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise StageError(f"tasks: unknown split {split!r}; known: {', '.join(SPLITS)}")


def sample(family: str, level: int, split: Split, rng: random.Random) -> Problem:
    """One problem of that family and level whose key falls in `split`."""
    fam = get_family(family)
    check_level(fam.name, level, fam.max_level)
    _check_split(split)
    for _ in range(MAX_TRIES):
        problem = fam.generate(rng, level)
        if split_of(problem.key) == split:
            return problem
    raise StageError(
        f"tasks: no {split} problem of family {fam.name!r} level {level} in {MAX_TRIES} draws"
    )


def problems(
    families: Sequence[str], levels: Sequence[int], split: Split, n: int, seed: int
) -> list[Problem]:
    """`n` problems of `split`, each of a family and level drawn uniformly from the lists.

    The same arguments give the same list on any machine: the only randomness is a
    `random.Random` seeded from (seed, split). Problems may repeat when a level has
    few problems in the split.
    """
    if not families or not levels:
        raise StageError("tasks: need at least one family and one level")
    if n < 0:
        raise StageError(f"tasks: n must be >= 0, not {n}")
    for name in families:
        fam = get_family(name)
        for level in levels:
            check_level(fam.name, level, fam.max_level)
    _check_split(split)
    digest = hashlib.sha256(f"stagetrain.tasks:{seed}:{split}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    return [sample(rng.choice(families), rng.choice(levels), split, rng) for _ in range(n)]
