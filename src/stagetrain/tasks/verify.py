"""Checking a model's completion against a problem's reference answer.

`score` is the GRPO reward, so it never raises: a completion is arbitrary model
output (unfinished, garbage, enormous) and one bad sample must not stop a step.
The answer is read from the last "Answer:" if there is one, else from the whole
completion, up to the first end marker; for an integer reference the last
integer there is the model's answer, so "I think it is 46." counts.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from stagetrain.tasks.problem import EOS_TOKEN, PROBLEM_TOKEN, Problem

END_MARKERS = (EOS_TOKEN, PROBLEM_TOKEN)
"""Where a completion ends: eos, or the model starting a new problem on its own."""

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_NUMBER = re.compile(
    r"(?:(?<![0-9])[-+])?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?"
)
_INTEGER = re.compile(r"(-?)([0-9]+)(?:\.0+)?")
_SIGNED = re.compile(r"[-+][0-9]")
_SEPARATED = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+")


def normalise(answer: str) -> str:
    """Lowercased, whitespace collapsed, edge punctuation, '+' and thousands separators dropped."""
    text = " ".join(answer.split()).lower().rstrip(string.punctuation + " ")
    text = text.lstrip("".join(c for c in string.punctuation if c not in "+-") + " ")
    if not _SIGNED.match(text):
        text = text.lstrip(string.punctuation + " ")
    if _SEPARATED.fullmatch(text):
        text = text.replace(",", "")
    text = text.removeprefix("+")
    if re.fullmatch(r"-0+", text):
        text = text[1:]
    return text


def _integer(text: str) -> tuple[str, str] | None:
    """(sign, digits without leading zeros) of a normalised integer, else None."""
    match = _INTEGER.fullmatch(text)
    if match is None:
        return None
    digits = match[2].lstrip("0") or "0"
    return ("" if digits == "0" else match[1]), digits


def is_integer(answer: str) -> bool:
    """Whether a reference answer is an integer ('46', '-3', '1,000'): its completion's answer is
    then the last number given."""
    return _integer(normalise(answer)) is not None


def extract_answer(text: str, *, numeric: bool = True) -> str | None:
    """The answer a completion gives, or None if it gives none.

    numeric: the reference is an integer, so take the last number in the answer
    text rather than the whole of it.
    """
    for marker in END_MARKERS:
        text = text.split(marker, 1)[0]
    parts = _ANSWER.split(text)
    if len(parts) > 1:
        text = parts[-1].split("\n", 1)[0]
    if numeric:
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return text.strip() or None


def exact(candidate: str, reference: str) -> float:
    """1.0 when the normalised texts are equal."""
    return float(normalise(candidate) == normalise(reference))


def numeric(candidate: str, reference: str) -> float:
    """1.0 when both are the same integer ('046' == '46', '1,000' == '1000'); else exact."""
    a, b = _integer(normalise(candidate)), _integer(normalise(reference))
    if a is None or b is None:
        return exact(candidate, reference)
    return float(a == b)


VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact": exact, "numeric": numeric}


def score(completion: str, problem: Problem) -> float:
    """The reward: 1.0 if the completion's answer matches, else 0.0; never raises."""
    try:
        verifier = VERIFIERS.get(problem.verifier)
        if not isinstance(completion, str) or verifier is None:
            return 0.0
        candidate = extract_answer(completion, numeric=is_integer(problem.answer))
        return 0.0 if candidate is None else verifier(candidate, problem.answer)
    except Exception:  # a reward must not stop a training step; unexpected input scores 0
        return 0.0
