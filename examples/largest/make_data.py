"""Writes largest.parquet, the problems of the worked example's family: the largest of three numbers.

    python examples/largest/make_data.py

Each row has the question, the answer, the numbers themselves (a column the reward
function reads: the pipeline hands every unmapped column to rewards under its own name)
and a difficulty, the numbers' count of digits, which the preset buckets into levels
with `level_edges: [3, 4]` (two digits: level 1, three: 2, four: 3).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = {2: 5000, 3: 3000, 4: 2000}
"""Problems per count of digits: level 1 is the one GRPO starts on and is evaluated at, so
it has the most held-out problems (about 250 of its 5,000)."""


def rows(seed: int = 0) -> list[dict[str, object]]:
    """Every problem, distinct questions, in a seeded order."""
    rng, out, seen = random.Random(seed), [], set()
    for digits, wanted in ROWS.items():
        while sum(r["difficulty"] == digits for r in out) < wanted:
            numbers = rng.sample(range(10 ** (digits - 1), 10**digits), 3)
            question = (
                f"Of {numbers[0]}, {numbers[1]} and {numbers[2]}, which number is the largest?"
            )
            if question not in seen:
                seen.add(question)
                out.append(
                    {
                        "question": question,
                        "largest": max(numbers),
                        "numbers": numbers,
                        "difficulty": digits,
                    }
                )
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("largest.parquet")
    pq.write_table(pa.Table.from_pylist(rows()), path)
    print(f"{path}: {sum(ROWS.values())} problems")
