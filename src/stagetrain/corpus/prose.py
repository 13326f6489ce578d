"""Templated prose: grammatical sentences from small word lists.

It gives the default corpus ordinary text between the task problems, so the
tokenizer learns words and the model learns more than arithmetic notation,
without downloading anything.
"""

from __future__ import annotations

import random

SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer",
            "our neighbour", "the child", "a young fox", "the baker", "the sailor")  # fmt: skip
VERBS = (
    "sees",
    "likes",
    "finds",
    "carries",
    "paints",
    "counts",
    "follows",
    "builds",
    "holds",
    "watches",
)
OBJECTS = ("a red ball", "the green door", "three apples", "a long letter", "the blue boat", "two stones",
           "a warm coat", "the tall tree", "five coins", "an empty box")  # fmt: skip
PLACES = ("in the garden", "near the river", "at the market", "on the hill", "by the window",
          "in the kitchen", "under the bridge")  # fmt: skip
TIMES = ("In the morning", "Every day", "After lunch", "On Sunday", "Later", "At night")


def sentence(rng: random.Random) -> str:
    """One sentence, e.g. 'In the morning the cat finds a red ball near the river.'"""
    body = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        body += f" {rng.choice(PLACES)}"
    if rng.random() < 0.3:
        return f"{rng.choice(TIMES)} {body}."
    return body[0].upper() + body[1:] + "."


def paragraph(rng: random.Random, sentences: tuple[int, int] = (2, 5)) -> str:
    """A document of a few sentences."""
    return " ".join(sentence(rng) for _ in range(rng.randint(*sentences)))
