"""Held-out accuracy of any consolidated model folder, per task family and level, with its
standard error; against a baseline folder, the gain.

    python -m stagetrain.evaluate results/tiny/model/grpo [--levels 1 2] [--problems 278]
    python -m stagetrain.evaluate results/tiny/model/grpo --baseline results/tiny/model/pretrain \\
        --families comparison counting --json gain.json
    python -m stagetrain.evaluate results/own-tasks/model/grpo --config config/presets/own-tasks.yaml \\
        --baseline results/own-tasks/model/pretrain

Greedy completions of held-out (test-split) problems, which no training stage
ever saw, scored by each family's rewards and `tasks.success_at`. With --config,
the run's tasks section gives its own families (files, rewards, chat template),
grpo.max_prompt_len / max_new_tokens the lengths, and evaluate.problems /
evaluate.levels the defaults of --problems / --levels; by default every family
the config names is scored. A file family's level is scored on each of its
held-out problems once, up to --problems. A line on stderr says what is being
measured, as it goes; stdout prints one line per family and level;
`--json` also writes the figures in the form of GRPO's summary (`accuracy` by
family and level, and with `--baseline` the `gain` report of stagetrain.evaluate.heldout).
The default number of problems keeps one standard error <= 0.03 at any accuracy.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import EvaluateSettings, Settings
from stagetrain.consolidate.manifest import MANIFEST
from stagetrain.errors import StageError
from stagetrain.evaluate.heldout import (
    AccuracyEntry,
    GainReport,
    accuracy_entry,
    gains,
    problems_for,
)
from stagetrain.io import atomic_write_json, read_json
from stagetrain.tasks import FAMILIES, get_family, heldout, known
from stagetrain.tasks.families import NO_TASKS, TaskSet, held_out_families, load_tasks
from stagetrain.tasks.judge import Judge
from stagetrain.training.evaluation import greedy_scores

Scores = dict[tuple[str, int], tuple[float, int, int]]
"""(family, level) -> (accuracy, problems scored, distinct problems among them)."""
Accuracy = dict[str, dict[str, AccuracyEntry]]
"""{family: {level (text, as JSON keys are): entry}}, as GRPO's summary has it."""


class Report(TypedDict):
    """The --json document (with the model, baseline and seed beside it): the accuracy, and
    with a baseline its accuracy and the gain report."""

    problems: int
    accuracy: Accuracy
    baseline_accuracy: NotRequired[Accuracy]
    gain: NotRequired[GainReport]


def load_model(folder: str) -> tuple[Any, Any]:
    """The tokenizer and fp32 model of `folder`. A consolidated folder's files are first held
    to the sizes its MANIFEST.json lists (cheap, and it names the file cut short); whatever
    else a damaged folder makes transformers or safetensors raise is one line naming it.

    Raises:
        StageError: one line naming the folder or its file.
    """
    manifest = Path(folder) / MANIFEST
    if manifest.is_file():
        doc = read_json(manifest)
        files = doc.get("files") if isinstance(doc, dict) else None
        for name, entry in (files if isinstance(files, dict) else {}).items():
            path, listed = (
                Path(folder) / name,
                entry.get("bytes") if isinstance(entry, dict) else None,
            )
            size = path.stat().st_size if path.is_file() else None
            if isinstance(listed, int) and size != listed:
                found = "missing" if size is None else f"{size:,} bytes"
                raise StageError(f"{path}: {found}, but {MANIFEST} lists {listed:,}: "
                                 "cut short or changed since consolidation")  # fmt: skip
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except Exception as err:  # safetensors', transformers' and torch's own, on a damaged folder
        first = (str(err).strip().splitlines() or [""])[0]
        raise StageError(
            f"{folder}: cannot load the model ({type(err).__name__}: {first})"
        ) from None
    return tokenizer, model


def accuracy(folder: str, families: list[str], levels: list[int], n: int, seed: int, *,
             tasks: TaskSet | None = None, lengths: tuple[int, int] = (64, 32)) -> Scores:  # fmt: skip
    """Accuracy by (family, level) on `n` held-out problems each (a file family: its held-out
    problems, at most n), for the levels a family has; `tasks` holds the families (default: the
    built-in ones), `lengths` the prompt and completion token limits."""
    began = time.monotonic()
    progress(f"{folder}: loading")
    tokenizer, model = load_model(folder)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.eval().to(device)
    judge = Judge(tasks or load_tasks(), tokenizer, max_prompt_len=lengths[0])
    out = {}
    todo = [(f, lv) for f in families for lv in levels if lv <= get_family(f).max_level]
    with torch.no_grad():
        for done, (family, level) in enumerate(todo, 1):
            batch = heldout(family, level, n, seed=seed)
            scores = greedy_scores(model, judge, batch, max_new_tokens=lengths[1], chunk_size=64)
            out[(family, level)] = (
                sum(scores) / len(scores),
                len(batch),
                len({p.key for p in batch}),
            )
            progress(f"{folder}: {family} level {level}: {out[(family, level)][0]:.3f} on {len(batch)} problems "
                     f"({done}/{len(todo)}, {time.monotonic() - began:.0f} s)")  # fmt: skip
    return out


def progress(line: str) -> None:
    """One line on stderr as the measurement goes (stdout keeps the table alone)."""
    print(line, file=sys.stderr)  # stderr is line-buffered: each line goes out whole


def report(results: Scores, baseline: Scores | None, n: int, level: int,
           curriculum: list[str] | None = None) -> Report:  # fmt: skip
    """The --json document: accuracy (and the baseline's) by family and level, and the gain
    (its mean over `curriculum`, default every family, as GRPO's summary has it)."""

    def nested(values: Scores) -> Accuracy:
        out: Accuracy = {}
        for (family, lv), value in values.items():
            out.setdefault(family, {})[str(lv)] = accuracy_entry(*value)
        return out

    def measured(values: Scores) -> dict[str, dict[int, tuple[float, int, int]]]:
        out: dict[str, dict[int, tuple[float, int, int]]] = {}
        for (family, lv), value in values.items():
            out.setdefault(family, {})[lv] = value
        return out

    doc = Report(problems=n, accuracy=nested(results))
    if baseline is not None:
        doc["baseline_accuracy"] = nested(baseline)
        doc["gain"] = gains(measured(baseline), measured(results), level=level, families=curriculum)
    return doc


def _table(doc: Report) -> list[str]:
    """The printed lines; without a baseline the accuracy is the last column."""
    if "gain" not in doc:
        lines = [f"{'family':<12} {'level':>5} {'problems':>8} {'se':>6} {'accuracy':>9}"]
        for family, levels in doc["accuracy"].items():
            for lv, e in levels.items():
                lines.append(
                    f"{family:<12} {lv:>5} {e['problems']:>8} {e['se']:>6.3f} {e['accuracy']:>9.3f}"
                )
        return lines
    lines = [
        f"{'family':<12} {'level':>5} {'problems':>8} {'baseline':>9} {'model':>7} {'gain':>7} {'se':>6}"
    ]
    for family, by_level in doc["gain"]["by_family"].items():
        for lv, g in by_level.items():
            lines.append(f"{family:<12} {lv:>5} {g['problems']:>8} {g['start']:>9.3f} {g['end']:>7.3f} "
                         f"{g['gain']:>+7.3f} {g['se']:>6.3f}")  # fmt: skip
    mean = doc["gain"]["mean"]
    if mean is not None:
        lines.append(f"mean gain at level {mean['level']} over {', '.join(mean['families'])}: "
                     f"{mean['gain']:+.3f} (se {mean['se']:.3f})")  # fmt: skip
    drop = doc["gain"]["largest_drop"]
    if drop is not None:
        lines.append(f"largest drop: {drop['family']} level {drop['level']}, {drop['gain']:+.3f} "
                     f"({drop['sigmas']:.1f} se)")  # fmt: skip
    return lines


def _parser() -> argparse.ArgumentParser:
    """The command line this module's docstring describes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a Hugging Face model folder (e.g. results/tiny/model/grpo)")
    parser.add_argument(
        "--baseline",
        help="a model folder to measure the gain against (e.g. results/tiny/model/pretrain)",
    )
    parser.add_argument(
        "--config", help="the run's config: its tasks section, families and prompt lengths"
    )
    parser.add_argument(
        "--families",
        nargs="+",
        help="default: every family the config names (without one: the built-in families)",
    )
    parser.add_argument("--levels", nargs="+", type=int,
                        help="default: the config's evaluate.levels, else 1 2")  # fmt: skip
    parser.add_argument("--problems", type=int,
                        help="held-out problems per family and level (default: the config's evaluate.problems, "
                             "else one se <= 0.03)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    return parser


def sizes(
    levels: list[int] | None, problems: int | None, evaluate: EvaluateSettings | None
) -> tuple[list[int], int]:
    """The levels and problems to measure: the flags where given, else the config's evaluate
    section's, else levels 1 and 2 at one standard error <= 0.03."""
    if evaluate is None:
        default_levels, default_problems = [1, 2], problems_for()
    else:
        default_levels, default_problems = list(evaluate.levels), evaluate.problems
    return levels or default_levels, default_problems if problems is None else problems


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    # Without a config: the built-in families at the default run's lengths, the mean over all.
    named, lengths, curriculum, tasks_section = list(FAMILIES), (64, 32), None, NO_TASKS
    evaluate = None
    try:
        if args.config:
            config = Settings.from_config(stconfig.load(args.config))
            named = held_out_families(config.grpo, config.data, config.tasks)
            curriculum, tasks_section = list(config.grpo.curriculum.families), config.tasks
            lengths = (config.grpo.max_prompt_len, config.grpo.max_new_tokens)
            evaluate = config.evaluate
        tasks = load_tasks(tasks_section)
    except StageError as err:
        sys.exit(f"error: {err}")
    levels, problems = sizes(args.levels, args.problems, evaluate)
    families = args.families or named
    unknown = [f for f in families if f not in known()]
    if unknown:
        sys.exit(f"error: --families: unknown family {unknown[0]!r} (known: {', '.join(known())}; "
                 "your own need --config with their tasks section)")  # fmt: skip
    if problems < 1:
        sys.exit(f"error: --problems: expected a positive number of problems, not {problems}")
    for name, folder in (("model", args.model), ("--baseline", args.baseline)):
        # transformers reads a path that is not a folder as a hub repo id, and fails deep inside.
        if folder is not None and not (Path(folder) / "config.json").is_file():
            sys.exit(f"error: {name}: {folder} is not a model folder (no config.json in it)")
    try:
        results = accuracy(args.model, families, levels, problems, args.seed,
                           tasks=tasks, lengths=lengths)  # fmt: skip
        baseline = None
        if args.baseline:
            baseline = accuracy(args.baseline, families, levels, problems, args.seed,
                                tasks=tasks, lengths=lengths)  # fmt: skip
    except StageError as err:  # a reward function that fails
        sys.exit(f"error: {err}")
    doc = report(results, baseline, problems, level=min(levels), curriculum=curriculum)
    print("\n".join(_table(doc)))
    if args.json:
        atomic_write_json(
            args.json, {"model": args.model, "baseline": args.baseline, "seed": args.seed, **doc}
        )


if __name__ == "__main__":
    main()
