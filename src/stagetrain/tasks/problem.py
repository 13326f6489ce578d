"""One generated problem, the text a model sees for it, and its split.

The split is a pure function of the problem's identity (its key), so the
training, validation and held-out test problems are disjoint by construction:
no bookkeeping of what was drawn before, and any process that generates a
problem agrees on which split it belongs to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stagetrain.errors import StageError

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")

PROBLEM_TOKEN = "<|problem|>"
ANSWER_TOKEN = "<|answer|>"
TASK_TOKENS = (PROBLEM_TOKEN, ANSWER_TOKEN)
EOS_TOKEN = "<|eos|>"
"""The trained tokenizer's end of a document, and of a completion."""

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    f"{{% if m['role'] == 'user' %}}{PROBLEM_TOKEN}{{{{ m['content'] }}}}{ANSWER_TOKEN}"
    f"{{% elif m['role'] == 'assistant' %}}{{{{ m['content'] }}}}{EOS_TOKEN}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
"""The trained tokenizer's chat template: a user message is the pipeline's own prompt markup,
`<|problem|>question<|answer|>` (the generation prompt is already its end), an assistant's is
its text and eos, a system message its text. So `apply_chat_template` of one user message
gives exactly the prompt the corpus taught, and a consolidated model folder (which copies the
tokenizer) is prompted right by plain transformers and by TRL's conversational datasets. It
lives with the markup, not in tokenizer/, so prompt rendering can tell it from a chat model's
without the tokenizer stage's code in its digest."""

TRAIN_PERCENT = 90
VAL_PERCENT = 5
"""The rest (5%) is the held-out test split."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A question with a checkable answer, shared by the pretraining corpus and GRPO."""

    family: str
    level: int
    """Difficulty, 1 = easiest."""
    question: str
    """What the model is asked, e.g. '12+34'."""
    answer: str
    """The canonical reference answer the verifier compares with, e.g. '46'."""
    solution: str
    """The worked text a model should produce, ending with the answer."""
    verifier: str = "exact"
    """A name in `stagetrain.tasks.verify.VERIFIERS`."""
    key: str
    """The problem's identity: two problems with the same key are the same problem."""
    origin: str = ""
    """Where a file family's problem came from ('tasks/sort.parquet:row 12'), for messages."""
    messages: tuple[Mapping[str, str], ...] | None = None
    """A conversational family's prompt, its chat messages (the prompt column holds a list of
    {role, content}, as TRL's `is_conversational` decides); `question` is then the last user
    message's content. None: the prompt is plain text."""
    columns: Mapping[str, Any] = field(default_factory=dict)
    """A file family's columns of the row (but "prompt"), which its reward functions receive by name."""

    def __post_init__(self) -> None:
        if self.level < 1:
            raise StageError(
                f"tasks: {self.family} problem {self.key!r} has level {self.level}, expected >= 1"
            )


def prompt(p: Problem) -> str:
    """What the model is conditioned on: the question between the task markers."""
    return f"{PROBLEM_TOKEN}{p.question}{ANSWER_TOKEN}"


def training_text(p: Problem) -> str:
    """One pretraining document; the tokenizer stage appends the eos token itself."""
    return prompt(p) + p.solution


def split_of(key: str) -> Split:
    """The split a problem belongs to, from a hash of its key (stable across runs and machines)."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    if bucket < TRAIN_PERCENT:
        return "train"
    if bucket < TRAIN_PERCENT + VAL_PERCENT:
        return "val"
    return "test"


def check_level(family: str, level: int, max_level: int) -> None:
    """Raise a one-line StageError unless 1 <= level <= max_level."""
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= max_level:
        raise StageError(f"tasks: family {family!r} has levels 1..{max_level}, not {level!r}")
