"""Held-out accuracy of any consolidated model folder, per task family and level.

    python -m stagetrain.evaluate results/tiny/model/grpo [--levels 1 2] [--problems 128]

Greedy completions of held-out (test-split) problems, which no training stage
ever saw, scored by the tasks' verifiers. Prints one line per family and level.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagetrain.tasks import FAMILIES, problems
from stagetrain.training.evaluation import greedy_scores


def accuracy(
    folder: str, families: list[str], levels: list[int], n: int, seed: int
) -> dict[tuple[str, int], float]:
    """Accuracy by (family, level) on `n` held-out problems each."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for family in families:
            for level in levels:
                batch = problems([family], [level], "test", n, seed=seed)
                scores = greedy_scores(
                    model, tokenizer, batch, max_prompt_len=64, max_new_tokens=32, chunk_size=64
                )
                out[(family, level)] = sum(scores) / len(scores)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a Hugging Face model folder (e.g. results/tiny/model/grpo)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--problems", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        sys.exit(f"error: --families: unknown family {unknown[0]!r} (known: {', '.join(FAMILIES)})")
    results = accuracy(args.model, args.families, args.levels, args.problems, args.seed)
    print(f"{'family':<12} {'level':>5} {'accuracy':>9}  ({args.problems} held-out problems each)")
    for (family, level), value in results.items():
        print(f"{family:<12} {level:>5} {value:>9.3f}")


if __name__ == "__main__":
    main()
