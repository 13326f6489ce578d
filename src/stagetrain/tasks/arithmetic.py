"""The "arithmetic" family: integer expressions over + - *, five levels.

Level 1: two-digit addition, 10..99 + 10..99 (8,100 problems).
Level 2: three-digit addition or subtraction with a non-negative result.
Level 3: a two-digit number times a one-digit number (2..9, either order), or a level-2 problem.
Level 4: three operands (2..20) mixing * with + or -, so precedence matters.
Level 5: four operands (2..20) over + - * with one pair of parentheses that changes the value.

Answers come from evaluating the expression tree, never from eval(). Levels 4-5
show each step in evaluation order ("3*4=12, 12+5=17. Answer: 17"); a result may
be negative there.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from stagetrain.errors import StageError
from stagetrain.tasks.problem import Problem, check_level

FAMILY = "arithmetic"
MAX_LEVEL = 5
MAX_TRIES = 1000

Node = int | tuple[str, "Node", "Node"]
OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def parse(tokens: Sequence[int | str]) -> Node:
    """The tree of a token list, * binding tighter than + and -, all left-associative."""
    node, end = _sum(tokens, 0)
    if end != len(tokens):
        raise StageError(f"arithmetic: unexpected {tokens[end]!r} in {render(tokens)!r}")
    return node


def _sum(tokens: Sequence[int | str], i: int) -> tuple[Node, int]:
    node, i = _product(tokens, i)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        right, j = _product(tokens, i + 1)
        node, i = (str(tokens[i]), node, right), j
    return node, i


def _product(tokens: Sequence[int | str], i: int) -> tuple[Node, int]:
    node, i = _atom(tokens, i)
    while i < len(tokens) and tokens[i] == "*":
        right, i = _atom(tokens, i + 1)
        node = ("*", node, right)
    return node, i


def _atom(tokens: Sequence[int | str], i: int) -> tuple[Node, int]:
    if i < len(tokens) and tokens[i] == "(":
        node, i = _sum(tokens, i + 1)
        if i >= len(tokens) or tokens[i] != ")":
            raise StageError(f"arithmetic: unbalanced parenthesis in {render(tokens)!r}")
        return node, i + 1
    if i < len(tokens) and isinstance(tokens[i], int):
        return int(tokens[i]), i + 1
    raise StageError(f"arithmetic: expected a number at token {i} of {render(tokens)!r}")


def evaluate(node: Node, steps: list[str] | None = None) -> int:
    """The value of a tree; each operation, in the order done, is appended to `steps`."""
    if isinstance(node, int):
        return node
    op, left, right = node
    a, b = evaluate(left, steps), evaluate(right, steps)
    value = OPS[op](a, b)
    if steps is not None:
        steps.append(f"{a}{op}{b}={value}")
    return value


def render(tokens: Sequence[int | str]) -> str:
    """The question text: tokens joined without spaces, e.g. '(3+4)*5'."""
    return "".join(str(t) for t in tokens)


def generate(rng: random.Random, level: int) -> Problem:
    """One problem of the given level."""
    check_level(FAMILY, level, MAX_LEVEL)
    tokens = _LEVELS[level - 1](rng)
    steps: list[str] = []
    value = evaluate(parse(tokens), steps)
    question = render(tokens)
    solution = str(value) if level <= 3 else f"{', '.join(steps)}. Answer: {value}"
    return Problem(
        family=FAMILY, level=level, question=question, answer=str(value),
        solution=solution, verifier="numeric", key=question,
    )  # fmt: skip


def _level1(rng: random.Random) -> list[int | str]:
    return [rng.randint(10, 99), "+", rng.randint(10, 99)]


def _level2(rng: random.Random) -> list[int | str]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    if rng.random() < 0.5:
        return [a, "+", b]
    return [max(a, b), "-", min(a, b)]


def _level3(rng: random.Random) -> list[int | str]:
    if rng.random() < 0.5:
        return _level2(rng)
    pair = [rng.randint(10, 99), rng.randint(2, 9)]
    rng.shuffle(pair)
    return [pair[0], "*", pair[1]]


def _level4(rng: random.Random) -> list[int | str]:
    ops = ["*", rng.choice("+-")]
    rng.shuffle(ops)
    a, b, c = (rng.randint(2, 20) for _ in range(3))
    return [a, ops[0], b, ops[1], c]


def _level5(rng: random.Random) -> list[int | str]:
    for _ in range(MAX_TRIES):
        numbers = [rng.randint(2, 20) for _ in range(4)]
        ops = [rng.choice("+-*") for _ in range(3)]
        flat: list[int | str] = [numbers[0]]
        for op, n in zip(ops, numbers[1:], strict=True):
            flat += [op, n]
        start, stop = rng.choice([(0, 2), (0, 3), (1, 3), (1, 4), (2, 4)])
        tokens = flat[: 2 * start] + ["("] + flat[2 * start : 2 * stop - 1] + [")"]
        tokens += flat[2 * stop - 1 :]
        if evaluate(parse(tokens)) != evaluate(parse(flat)):
            return tokens
    raise StageError(
        f"arithmetic: no level-5 problem with meaningful parentheses in {MAX_TRIES} tries"
    )


_LEVELS = (_level1, _level2, _level3, _level4, _level5)
