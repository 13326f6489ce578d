"""The completions table: what the policy wrote at a step, and what each reward made of it.

TRL's `log_completions` logs, every logging step, a table of the step's prompts, completions,
each reward function's value and the advantage, with the columns reward functions add through
`log_extra`. GRPO here keeps the same table every `grpo.log_completions_every` steps as
`completions.jsonl` (one record per completion) and renders it into the Snakemake report, where a
person reads what the model says rather than a mean that hides it.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from stagetrain.io import atomic_write_text


class CompletionRecord(TypedDict):
    """One completion of a logged step (COMPLETION_RECORD says what each key means)."""

    step: int
    family: str
    level: int
    prompt: str
    completion: str
    completion_ids: list[int]
    reward: float
    rewards: dict[str, float | None]
    advantage: float
    extra: dict[str, Any]


COMPLETION_RECORD = {
    "step": "the GRPO step the completion was sampled at",
    "family": "its problem's task family",
    "level": "its problem's curriculum level",
    "prompt": "the prompt as the model was given it (chat template included), decoded",
    "completion": "the completion as the reward functions got it: decoded up to its end token",
    "completion_ids": "its token ids as the reward functions got them (up to its end token)",
    "reward": "the weighted sum of the family's reward terms",
    "rewards": "each term's own value, unweighted, by its name (null where the function gave None)",
    "advantage": "its advantage (the mean over its tokens: a tree's differ along the path)",
    "extra": "what reward functions logged for it with log_extra, by column",
}

TABLE_ROWS = 64
"""Rows of each step the report's table shows (the file keeps them all)."""
STYLE = ("body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}"
         "td{white-space:pre-wrap;max-width:40em}")  # fmt: skip
"""The page's look: ruled cells, and completions wrapped as written (newlines kept)."""


def logged_at(every: int, step: int, last: int) -> bool:
    """Whether `step` is one whose completions are kept: every `every` steps and the run's
    `last` (so a run shorter than `every` still shows what it ends with); 0: none."""
    return every > 0 and (step % every == 0 or step == last)


def term_values(terms: Sequence[tuple[str, float]]) -> dict[str, float | None]:
    """A completion's (name, value) terms as the table's column: NaN (a term that gave None,
    as `tasks.rewards.weighted` records it) is null, which JSON can hold."""
    return {name: None if math.isnan(value) else value for name, value in terms}


def write_table(records: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """The report's table: the first and the last logged step (what the model wrote before
    training moved it, and after), `TABLE_ROWS` rows of each, as an HTML page."""
    steps = sorted({r["step"] for r in records})
    shown = list(dict.fromkeys(steps[:1] + steps[-1:]))
    terms = list(dict.fromkeys(name for r in records for name in r["rewards"]))
    extras = list(dict.fromkeys(name for r in records for name in r["extra"]))
    head = [
        "step",
        "family",
        "level",
        "prompt",
        "completion",
        "reward",
        *terms,
        "advantage",
        *extras,
    ]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif value is None:
            value = ""
        elif not isinstance(value, str):
            value = json.dumps(value)
        return f"<td>{html.escape(str(value))}</td>"

    rows = []
    for step in shown:
        for r in [r for r in records if r["step"] == step][:TABLE_ROWS]:
            values = [r["step"], r["family"], r["level"], r["prompt"], r["completion"], r["reward"],
                      *(r["rewards"].get(t) for t in terms), r["advantage"],
                      *(r["extra"].get(e) for e in extras)]  # fmt: skip
            rows.append("<tr>" + "".join(cell(v) for v in values) + "</tr>")
    if not rows:
        body = "<p>No step logged its completions (grpo.log_completions_every is 0).</p>"
    else:
        header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    atomic_write_text(path, f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>GRPO completions</title>"
                            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")  # fmt: skip
