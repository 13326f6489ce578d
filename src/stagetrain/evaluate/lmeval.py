"""lm-evaluation-harness on a consolidated model folder: the run's held-out problems as local
task definitions, scored by the run's own rewards, beside any lm-eval tasks the user names.

Users compare models with lm-evaluation-harness, so the `evaluate` target hands each model
folder to it rather than to a scorer of our own. What makes its figure the pipeline's: each
family and level of the held-out split (problems no stage trained on, as `heldout` draws them
for GRPO's summary and `python -m stagetrain.evaluate`) becomes one lm-eval task, written here:
- a JSON-lines file of prompts rendered as the stages render them (`Prompter`: special tokens,
  chat template), each checked to encode back to the same token ids, since the harness
  tokenizes text;
- a YAML file: greedy generation stopped where the stages stop it (eos, or a new problem begun)
  after grpo.max_new_tokens, and `process_results` in a scoring module beside it, which scores
  a completion with the family's weighted rewards and `tasks.success_at` (`Scorer`).
The harness returns text without its end token; a completion counts as finished (the format
reward asks for it) when it re-encodes to fewer than max_new_tokens tokens.
Nothing is downloaded: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set before lm-eval loads,
so a user's task must find its data in the local cache.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypedDict

import yaml

from stagetrain.config.settings import TasksSettings
from stagetrain.errors import StageError
from stagetrain.evaluate.heldout import AccuracyEntry, accuracy_entry
from stagetrain.io import atomic_write_json, atomic_write_text
from stagetrain.tasks import heldout
from stagetrain.tasks.families import TaskSet, load_tasks
from stagetrain.tasks.problem import PROBLEM_TOKEN, Problem
from stagetrain.tasks.prompts import Prompter
from stagetrain.tasks.rewards import Completion, weighted

PREFIX = "stagetrain"
"""The name of every task written here starts with it: `stagetrain_<family>_level<level>`."""
MISSING = (
    "evaluate: lm-eval is not installed; install the eval extra (pip install 'stagetrain[eval]')"
)


class TaskDoc(TypedDict):
    """One line of a written task's JSON lines file: lm-eval hands it back to `Scorer`."""

    family: str
    level: int
    index: int
    """The problem's place in `Run.problems_of(family, level)`."""
    text: str
    """The prompt as the stages render it."""
    answer: str


class LmEvalResult(TypedDict):
    """What one lm-eval run measured: {family: {level (text): entry}} of the held-out tasks,
    the user's tasks with lm-eval's own metrics ({task: {'acc,none': value, ...}}, its keys
    and values as the harness gives them), and the harness's version."""

    accuracy: dict[str, dict[str, AccuracyEntry]]
    tasks: dict[str, dict[str, Any]]
    lm_eval: str


class StageEvaluation(LmEvalResult):
    """evaluate/<stage>.json (scripts/evaluate.py): the result, with what it was measured on."""

    stage: str
    model: str
    problems: int
    seed: int


@dataclass(frozen=True)
class Run:
    """What the held-out tasks of one model are made of (run.json beside them)."""

    model: str
    """The model folder: its tokenizer renders the prompts."""
    tasks: Mapping[str, Any]
    """The config's validated tasks section (file families, rewards, chat template) as the
    config gives it: run.json holds it for the scoring module, which builds its settings."""
    families: Sequence[str]
    levels: Sequence[int]
    problems: int
    seed: int
    max_prompt_len: int
    max_new_tokens: int
    pins: Mapping[str, str]
    """Hub task files' commits, as the tokenizer stage resolved them (data/meta.json)."""

    @classmethod
    def read(cls, path: Path) -> Run:
        return cls(**json.loads(Path(path).read_text()))

    @cached_property
    def task_set(self) -> TaskSet:
        """The run's task families, file families read and registered."""
        return load_tasks(TasksSettings.from_config(self.tasks, "tasks"), pins=self.pins)

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model)

    def cells(self) -> list[tuple[str, int]]:
        """(family, level) of every task: the levels each family has."""
        known = self.task_set.families  # loading them registers the file families
        missing = [f for f in self.families if f not in known]
        if missing:
            raise StageError(f"evaluate: no task family {missing[0]!r} in the run's tasks section")
        return [
            (f, lv) for f in self.families for lv in self.levels if lv <= known[f].family.max_level
        ]

    def problems_of(self, family: str, level: int) -> list[Problem]:
        """The held-out problems of one task, as `stagetrain.evaluate` draws them."""
        if family not in self.task_set.families:  # loading them registers the file families
            raise StageError(f"evaluate: no task family {family!r} in the run's tasks section")
        return heldout(family, level, self.problems, seed=self.seed)


def task_name(family: str, level: int) -> str:
    return f"{PREFIX}_{family}_level{level}"


class Scorer:
    """`process_results` of the written tasks: 1.0 when the completion solves its problem."""

    def __init__(self, run_json: Path) -> None:
        self.run = Run.read(run_json)
        self._problems: dict[tuple[str, int], list[Problem]] = {}

    def __call__(self, doc: TaskDoc, text: str) -> float:
        cell = (doc["family"], doc["level"])
        if cell not in self._problems:
            self._problems[cell] = self.run.problems_of(*cell)
        problem = self._problems[cell][doc["index"]]
        ids = self.run.tokenizer(text, add_special_tokens=False)["input_ids"]
        done = Completion(text=text, finished=len(ids) < self.run.max_new_tokens, ids=ids)
        tasks = self.run.task_set
        reward = weighted(tasks.rewards(problem.family), [problem], [done])[0]
        return float(reward >= tasks.success_at(problem.family))


_SCORING = '''"""Written by stagetrain.evaluate.lmeval: lm-eval's process_results for the tasks beside it."""

from pathlib import Path

from stagetrain.evaluate.lmeval import Scorer

_score = Scorer(Path(__file__).with_name("run.json"))


def process_results(doc, results):
    return {"acc": _score(doc, results[0])}
'''


def write_tasks(folder: Path, run: Run) -> dict[str, tuple[str, int, int]]:
    """The task files of `run` in `folder`: {task name: (family, level, distinct problems)}.

    Raises:
        StageError: a prompt longer than grpo.max_prompt_len, or one whose text does not
            encode back to its token ids (the harness would ask another question).
    """
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "run.json", asdict(run))
    atomic_write_text(folder / "scoring.py", _SCORING)
    tokenizer = run.tokenizer
    prompter = Prompter(
        tokenizer, chat_template=run.task_set.chat_template, limit=run.max_prompt_len
    )
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(PROBLEM_TOKEN)]
    stops = [s for s in stops if s is not None and s != tokenizer.unk_token_id]
    written = {}
    for family, level in run.cells():
        problems = run.problems_of(family, level)
        lines = []
        for index, problem in enumerate(problems):
            ids = prompter.ids(problem)
            text = tokenizer.decode(ids, skip_special_tokens=False)
            if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
                raise StageError(f"evaluate: the prompt of {family} problem {problem.key!r} does not encode "
                                 "back to its token ids, so lm-eval would ask another question")  # fmt: skip
            row = TaskDoc(family=family, level=level, index=index, text=text, answer=problem.answer)
            lines.append(json.dumps(row))
        name = task_name(family, level)
        data = folder / f"{name}.jsonl"
        atomic_write_text(data, "\n".join(lines) + "\n")
        atomic_write_text(folder / f"{name}.yaml", _task_yaml(name, data, run, tokenizer, stops))
        written[name] = (family, level, len({p.key for p in problems}))
    return written


def _task_yaml(name: str, data: Path, run: Run, tokenizer: Any, stops: list[int]) -> str:
    """One task definition (written as text: `!function` is no plain YAML)."""
    until = [tokenizer.convert_ids_to_tokens(s) for s in stops]
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data.resolve()))}}}}}",
        "test_split: test",
        "output_type: generate_until",
        "doc_to_text: text",
        "doc_to_target: answer",
        "process_results: !function scoring.process_results",
        f"generation_kwargs: {{until: {json.dumps(until)}, max_gen_toks: {run.max_new_tokens}, "
        f"do_sample: false, eos_token_id: {json.dumps(stops)}}}",
        "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]",
        "metadata: {version: 1}",
        "",
    ])  # fmt: skip


def evaluate(run: Run, folder: Path, extra: Sequence[str], batch_size: int) -> LmEvalResult:
    """Run lm-eval once on the model of `run`: the held-out tasks written to `folder`, and the
    user's `extra` tasks (names lm-eval knows, or task YAML files). Returns {accuracy: {family: {level: entry}}, tasks: {name:
    {metric: value}}, lm_eval: version}.

    Raises:
        StageError: lm-eval missing, an unknown task name, or a task lm-eval cannot run.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise StageError(MISSING) from err
    ours = write_tasks(folder, run)
    files = {task: _task_file_name(Path(task)) for task in extra if Path(task).is_file()}
    theirs = [files.get(task, task) for task in extra]
    # lm-eval's own catalogue (thousands of task files, about 6 s to index) only when a task
    # is named from it rather than given as a file.
    manager = TaskManager(
        include_path=[str(folder), *{str(Path(t).resolve().parent) for t in files}],
        include_defaults=len(files) < len(extra),
    )
    unknown = [task for task in theirs if task not in manager.all_tasks]
    if unknown:
        raise StageError(
            f"evaluate.tasks: lm-eval knows no task {unknown[0]!r}, and it is no task file"
        )
    import torch

    try:
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": run.model, "dtype": "float32", "add_bos_token": False},
            tasks=[*ours, *theirs],
            task_manager=manager,
            batch_size=batch_size,
            device="cuda" if torch.cuda.is_available() else "cpu",
            random_seed=run.seed,
            numpy_random_seed=run.seed,
            torch_random_seed=run.seed,
            fewshot_random_seed=run.seed,
        )
    except Exception as err:  # a user task whose data is not on this machine, in lm-eval's words
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"evaluate.tasks: lm-eval could not run them: {first}") from err
    results = out["results"]
    accuracy: dict[str, dict[str, AccuracyEntry]] = {}
    for name, (family, level, distinct) in ours.items():
        n = out["n-samples"][name]["effective"]
        accuracy.setdefault(family, {})[str(level)] = accuracy_entry(
            results[name]["acc,none"], n, distinct
        )
    tasks = {name: {k: v for k, v in metrics.items() if k != "alias"}
             for name, metrics in results.items() if name not in ours}  # fmt: skip
    return LmEvalResult(accuracy=accuracy, tasks=tasks, lm_eval=lm_eval.__version__)


class _AnyTag(yaml.SafeLoader):  # type: ignore[misc]  # Any: PyYAML ships no types
    """Reads a task file's plain keys; tags such as `!function` (lm-eval's own) come back None."""


_AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)


def _task_file_name(path: Path) -> str:
    """The `task` name a user's lm-eval task file declares."""
    try:
        name = yaml.load(path.read_text(), Loader=_AnyTag).get("task")  # noqa: S506 (a SafeLoader)
    except (OSError, yaml.YAMLError, AttributeError) as err:
        raise StageError(
            f"evaluate.tasks: {path}: not a readable lm-eval task file ({err})"
        ) from err
    if not isinstance(name, str):
        raise StageError(f"evaluate.tasks: {path}: no `task` name in it")
    return name


def table(doc: LmEvalResult) -> str:
    """The table, tab-separated (for a spreadsheet): one row per held-out cell and user metric."""
    rows = ["task\tlevel\tproblems\tmetric\tvalue\tse"]
    for family, levels in doc["accuracy"].items():
        for level, e in levels.items():
            rows.append(
                f"{family}\t{level}\t{e['problems']}\taccuracy\t{e['accuracy']:.4f}\t{e['se']:.4f}"
            )
    for name, metrics in doc["tasks"].items():
        for key, value in metrics.items():
            metric, _, _ = key.partition(",")
            if isinstance(value, float) and not metric.endswith("_stderr"):
                se = metrics.get(key.replace(metric, f"{metric}_stderr", 1))
                se_text = f"{se:.4f}" if isinstance(se, float) else ""
                rows.append(f"{name}\t\t\t{metric}\t{value:.4f}\t{se_text}")
    return "\n".join(rows) + "\n"


PAGE_STYLE = (
    "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:3px 6px}td{text-align:right}"
    "td:first-child,td:nth-child(4){text-align:left}"
)
"""Ruled cells, numbers to the right (as grpo/completions.html looks)."""


def table_page(tsv: str, stage: str) -> str:
    """The table as the report shows it: an HTML page, cell for cell the TSV's text. Snakemake's
    report draws only images, HTML and PDF inside itself; a TSV is a download link there, so
    the rows reached a person only through a spreadsheet."""
    head, *rows = (line.split("\t") for line in tsv.splitlines())

    def row(cells: list[str], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    body = "".join(row(r, "td") for r in rows)
    title = html.escape(f"Evaluation of the {stage} model")
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{PAGE_STYLE}</style></head><body><table><thead>{row(head, 'th')}</thead>"
        f"<tbody>{body}</tbody></table></body></html>\n"
    )
