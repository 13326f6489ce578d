"""The completions table's pure parts: which steps log, and the page the report shows."""

from __future__ import annotations

import math
from html.parser import HTMLParser
from pathlib import Path

from stagetrain.grpo.completions import TABLE_ROWS, logged_at, term_values, write_table


class Page(HTMLParser):
    """The page as a reader sees it: the header cells, each body row's cells, the messages,
    and any text that stands outside all of these (there should be none)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.head: list[str] = []
        self.rows: list[list[str]] = []
        self.paragraphs: list[str] = []
        self.stray: list[str] = []
        self._open: str | None = None  # the element whose text is being read
        self._in_head = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._in_head = self._in_head or tag == "thead"
        if tag == "tr" and not self._in_head:
            self.rows.append([])
        if tag in ("th", "td", "p", "title", "style"):
            self._open = tag
        if tag == "td":
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_head = self._in_head and tag != "thead"
        if tag == self._open:
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open == "th":
            self.head.append(data)
        elif self._open == "td":
            self.rows[-1][-1] += data
        elif self._open == "p":
            self.paragraphs.append(data)
        elif self._open is None and data.strip():
            self.stray.append(data)


def record(step: int, completion: str, **rewards: float | None) -> dict:
    return {"step": step, "family": "mine", "level": 1, "prompt": "<|problem|>1+1<|answer|>",
            "completion": completion, "completion_ids": [1, 2], "reward": 1.0, "rewards": rewards,
            "advantage": 0.5, "extra": {"parsed": ["2"]}}  # fmt: skip


def test_completions_are_logged_every_so_many_steps_and_at_the_last() -> None:
    assert [s for s in range(1, 26) if logged_at(10, s, 25)] == [10, 20, 25]
    assert [s for s in range(1, 4) if logged_at(10, s, 3)] == [3]
    assert [s for s in range(1, 4) if logged_at(1, s, 3)] == [1, 2, 3]
    assert not any(logged_at(0, s, 3) for s in range(1, 4))


def test_a_term_that_gave_none_is_null_in_the_table() -> None:
    assert term_values([("a", 1.0), ("b", math.nan)]) == {"a": 1.0, "b": None}


def test_the_page_shows_the_first_and_last_logged_steps_escaped_with_every_column(
    tmp_path: Path,
) -> None:
    records = [record(s, f"<think>step {s}</think>", acc=1 / 3, fmt=None) for s in (2, 4, 6)]
    records += [record(6, f"row {i}", acc=0.0) for i in range(TABLE_ROWS + 5)]
    write_table(records, tmp_path / "t.html")
    text = (tmp_path / "t.html").read_text()
    page = Page(text)
    assert page.head == ["step", "family", "level", "prompt", "completion", "reward", "acc", "fmt",
                         "advantage", "parsed"]  # fmt: skip
    assert "<think>" not in text and page.stray == []
    # step 2's row, and step 6's first TABLE_ROWS; floats to 4 digits, a term without a value blank
    assert len(page.rows) == 1 + TABLE_ROWS and {len(row) for row in page.rows} == {len(page.head)}
    assert page.rows[0] == ["2", "mine", "1", "<|problem|>1+1<|answer|>", "<think>step 2</think>", "1",
                            "0.3333", "", "0.5", '["2"]']  # fmt: skip
    assert [row[4] for row in page.rows[1:3]] == ["<think>step 6</think>", "row 0"]
    assert page.rows[2][6:8] == ["0", ""]
    assert "step 4" not in text


def test_a_run_that_logged_nothing_says_why(tmp_path: Path) -> None:
    write_table([], tmp_path / "t.html")
    page = Page((tmp_path / "t.html").read_text())
    assert page.paragraphs == ["No step logged its completions (grpo.log_completions_every is 0)."]
    assert page.rows == [] and page.stray == []
