"""The task families by name, and reproducible draws of problems from one split.

The built-in families generate problems; a draw for a split is rejection
sampling: generate, keep the problem if its key hashes to that split. Each level
of each has hundreds of problems or more, so a split is reached in a few dozen
tries and the bound is only a guard. A family of the user's task files
(`stagetrain.tasks.families`) is a pool of problems by level and split,
registered here by the process that loaded it, so the corpus, the curriculum
and the evaluation draw from both kinds alike.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stagetrain.errors import StageError
from stagetrain.tasks import arithmetic, text
from stagetrain.tasks.problem import SPLITS, Problem, Split, check_level, split_of

MAX_TRIES = 2000


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Problems at difficulty levels 1..max_level: generated, or a pool from files."""

    name: str
    max_level: int
    generate: Callable[[random.Random, int], Problem] | None = None
    pool: Mapping[tuple[int, Split], Sequence[Problem]] | None = None
    """(level, split) -> the problems a file family holds there."""


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


_FILE_FAMILIES: dict[str, Family] = {}


def register(families: Sequence[Family]) -> None:
    """Make these file families known to this process (replacing those registered before)."""
    _FILE_FAMILIES.clear()
    _FILE_FAMILIES.update({f.name: f for f in families})


def known() -> list[str]:
    """Every family name this process can draw from, sorted."""
    return sorted({*FAMILIES, *_FILE_FAMILIES})


def get_family(name: str) -> Family:
    """The family of that name, or a StageError listing the known ones."""
    family = _FILE_FAMILIES.get(name) or FAMILIES.get(name)
    if family is None:
        raise StageError(f"tasks: unknown family {name!r}; known: {', '.join(known())}")
    return family


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise StageError(f"tasks: unknown split {split!r}; known: {', '.join(SPLITS)}")


def sample(family: str, level: int, split: Split, rng: random.Random) -> Problem:
    """One problem of that family and level whose key falls in `split`."""
    fam = get_family(family)
    check_level(fam.name, level, fam.max_level)
    _check_split(split)
    if fam.pool is not None:
        pool = fam.pool.get((level, split))
        if not pool:
            raise StageError(f"tasks: family {fam.name!r} has no {split} problem at level {level}")
        return rng.choice(pool)
    assert fam.generate is not None
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


def heldout(family: str, level: int, n: int, seed: int) -> list[Problem]:
    """The held-out problems an evaluation scores for one family and level: `n` draws (with
    replacement) of a generated family, as `problems` makes them; of a file family, its test
    problems without replacement in a seeded order, at most `n` (each counts once, so the
    standard error is that of the problems there are)."""
    fam = get_family(family)
    if fam.pool is None:
        return problems([family], [level], "test", n, seed)
    check_level(fam.name, level, fam.max_level)
    pool = list(fam.pool.get((level, "test"), ()))
    random.Random(f"stagetrain.tasks:{seed}:{family}:{level}:heldout").shuffle(pool)
    return pool[:n]
