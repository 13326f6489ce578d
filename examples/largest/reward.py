"""The worked example's reward: full credit for the largest number, partial for one of the others.

TRL's signature: the pipeline passes the prompts, the completions and, by name, every
column of largest.parquet that the preset does not map, so `numbers` arrives as a list
of each row's three numbers.

Why partial credit: after pretraining, the tiny model often answers a number that is
none of the three (a digit copied wrong). Naming one of them is half the skill, and a
reward of 0 for both kinds of wrong answer would not tell GRPO which is closer.
"""

from __future__ import annotations

import re


def score(
    prompts: list[str], completions: list[str], numbers: list[list[int]], **kwargs: object
) -> list[float]:
    """1.0 when the answer (the last number of the completion, or after its last "Answer:")
    is the largest of the row's numbers; 0.25 when it is one of the others; else 0."""
    out = []
    for completion, given in zip(completions, numbers, strict=True):
        said = re.findall(r"-?\d+", completion.rsplit("Answer:", 1)[-1])
        answer = int(said[-1]) if said else None
        out.append(1.0 if answer == max(given) else 0.25 if answer in given else 0.0)
    return out
