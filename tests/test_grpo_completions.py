"""The completions table's pure parts: which steps log, and the page the report shows."""

from __future__ import annotations

import math
import re
from pathlib import Path

from stagetrain.grpo.completions import TABLE_ROWS, logged_at, term_values, write_table


def record(step: int, completion: str, **rewards: float | None) -> dict:
    return {"step": step, "family": "mine", "level": 1, "prompt": "<|problem|>1+1<|answer|>",
            "completion": completion, "completion_ids": [1, 2], "reward": 1.0, "rewards": rewards,
            "advantage": 0.5, "extra": {"parsed": ["2"]}}  # fmt: skip


def test_completions_are_logged_every_so_many_steps_and_at_the_last() -> None:
    assert [s for s in range(1, 26) if logged_at(10, s, 25)] == [10, 20, 25]
    assert [s for s in range(1, 4) if logged_at(10, s, 3)] == [3]
    assert not any(logged_at(0, s, 3) for s in range(1, 4))


def test_a_term_that_gave_none_is_null_in_the_table() -> None:
    assert term_values([("a", 1.0), ("b", math.nan)]) == {"a": 1.0, "b": None}


def test_the_page_shows_the_first_and_last_logged_steps_escaped_with_every_column(
    tmp_path: Path,
) -> None:
    records = [record(s, f"<think>step {s}</think>", acc=1.0, fmt=None) for s in (2, 4, 6)]
    records += [record(6, f"row {i}", acc=0.0) for i in range(TABLE_ROWS + 5)]
    write_table(records, tmp_path / "t.html")
    page = (tmp_path / "t.html").read_text()
    head = re.findall(r"<th>([^<]*)</th>", page)
    assert head == ["step", "family", "level", "prompt", "completion", "reward", "acc", "fmt",
                    "advantage", "parsed"]  # fmt: skip
    assert "&lt;think&gt;step 2&lt;/think&gt;" in page and "<think>" not in page
    assert "step 4" not in page and "step 6" in page
    rows = page.count("<tr>") - 1
    assert rows == 1 + TABLE_ROWS  # step 2's row, and step 6's first TABLE_ROWS
    assert "<td>&quot;2&quot;</td>" not in page and "<td>[&quot;2&quot;]</td>" in page


def test_a_run_that_logged_nothing_says_why(tmp_path: Path) -> None:
    write_table([], tmp_path / "t.html")
    assert "log_completions_every" in (tmp_path / "t.html").read_text()
