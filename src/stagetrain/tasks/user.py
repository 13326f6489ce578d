"""User-supplied tasks: a jsonl file of prompts with reference answers.

Each non-blank line is {"prompt": str, "answer": str, "level": int >= 1} plus an
optional "verifier" (a name in VERIFIERS, default "exact"). The family is the
file's stem and the key is the prompt, so user tasks split like generated ones.
The first bad row stops the load with 'path:line: what is wrong', so a typo is
found before a training run starts, not when its problem is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagetrain.errors import StageError
from stagetrain.tasks.problem import TASK_TOKENS, Problem
from stagetrain.tasks.verify import END_MARKERS, VERIFIERS

FIELDS = {"prompt": str, "answer": str, "level": int, "verifier": str}
CONTROL_TOKENS = (*TASK_TOKENS, *END_MARKERS, "<|bos|>", "<|pad|>")
"""Strings a task row must not hold: its text goes into the generated corpus, where these are
control tokens (stagetrain.tokenizer.SPECIAL_TOKENS and the task markers), so a prompt with
"<|pad|>" would become a pad token, and one with "<|problem|>" a second, fake problem."""
REQUIRED = ("prompt", "answer", "level")
MAX_ROW_CHARACTERS = 65_536
"""A task is a question and its answer: a row longer than this is a mistake (a 30 MB row ran BPE
training for more than five minutes, a 1 MB one made train.bin 6.7x train_tokens)."""


def load_user_tasks(path: str | Path) -> list[Problem]:
    """The problems of a user jsonl file, in file order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise StageError(f"{path}: cannot read user tasks ({exc})") from None
    out: list[Problem] = []
    first_seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        problem = _problem(path, number, _row(path, number, line))
        if problem.key in first_seen:
            raise StageError(
                f"{path}:{number}: duplicate prompt, first given on line {first_seen[problem.key]}"
            )
        first_seen[problem.key] = number
        out.append(problem)
    if not out:
        raise StageError(f"{path}: no tasks; expected one JSON object per line")
    return out


def _row(path: Path, number: int, line: str) -> dict[str, Any]:
    where = f"{path}:{number}"
    if len(line) > MAX_ROW_CHARACTERS:
        raise StageError(f"{where}: a row of {len(line):,} characters; a task row holds at most {MAX_ROW_CHARACTERS:,}")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise StageError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise StageError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in row:
        if key not in FIELDS:
            raise StageError(f"{where}: unknown key {key!r}; expected keys: {', '.join(FIELDS)}")
    for key in REQUIRED:
        if key not in row:
            raise StageError(f"{where}: missing {key!r} ({FIELDS[key].__name__})")
    for key, value in row.items():
        expected = FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise StageError(
                f"{where}: {key!r} must be {expected.__name__}, got {type(value).__name__}"
            )
    return row


def _problem(path: Path, number: int, row: dict[str, Any]) -> Problem:
    where = f"{path}:{number}"
    for key in ("prompt", "answer"):
        if not row[key].strip():
            raise StageError(f"{where}: {key!r} must be a non-empty string")
    for marker in CONTROL_TOKENS:
        if marker in row["prompt"] or marker in row["answer"]:
            raise StageError(f"{where}: prompt and answer must not contain the control token {marker!r}")
    if row["level"] < 1:
        raise StageError(f"{where}: 'level' must be an integer >= 1, got {row['level']}")
    verifier = row.get("verifier", "exact")
    if verifier not in VERIFIERS:
        raise StageError(
            f"{where}: unknown verifier {verifier!r}; expected one of {', '.join(VERIFIERS)}"
        )
    return Problem(
        family=path.stem, level=row["level"], question=row["prompt"], answer=row["answer"],
        solution=row["answer"], verifier=verifier, key=row["prompt"],
    )  # fmt: skip
