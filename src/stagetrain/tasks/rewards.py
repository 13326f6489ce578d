"""A task family's reward: built-in verifiers and the user's Python functions, weighted.

A user function has TRL's signature, `fn(prompts, completions, **columns) -> list[float | None]`,
so a reward written for TRL runs here unchanged:

- `prompts`: the questions (the dataset's prompt column), `completions`: the model's text,
  decoded up to its end token (eos, or the model starting a new problem), without it;
- keyword lists, one entry per row: `answer` (the reference, as text), `level`, `finished`
  (the model ended the completion itself, within grpo.max_new_tokens), `completion_ids`, and
  every column of the family's files that `columns` does not map, under its own name.

`None` means "not applicable to this row" (as in TRL): the row's weighted sum leaves that
function out, and a row no function applies to scores 0. The reward of a completion is
sum(weight * value). A reward file is the user's own code, imported and run in every GRPO
rank for that rank's completions (each rank scores what it sampled, so no rank waits on
another's scoring and nothing is sent between them) and by `stagetrain.evaluate`.

A user function that raises, returns the wrong number of values, or a value that is not a
finite number or None is bad input: the stage stops with one line naming the file, the
function and the first bad row, before the step's update is applied. Built-in verifiers
never raise (`verify.score`): one odd completion must not stop a run.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from stagetrain.config.settings import RewardSpec
from stagetrain.errors import StageError
from stagetrain.tasks.problem import Problem
from stagetrain.tasks.verify import extract_answer, is_integer, score

RESERVED = ("prompts", "completions", "answer", "level", "finished", "completion_ids")
"""The keyword names every reward call passes; a dataset column may not take one of them."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion as rewards see it."""

    text: str
    """Decoded up to its end token (eos, or the model starting a new problem)."""
    finished: bool
    """The model ended it itself, before the token budget ran out."""
    ids: list[int]


def _math(text: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference (1/2 = 0.5 =
    \\frac{1}{2}); the answer is read after the last "Answer:" if there is one."""
    from math_verify import parse, verify

    candidate = extract_answer(text, numeric=False)
    if candidate is None:
        return 0.0
    try:
        return float(verify(parse(answer), parse(candidate)))
    except Exception:  # math-verify's parsers on arbitrary model output; unparsable is wrong
        return 0.0


VERIFIERS: dict[str, Callable[[Completion, Problem], float]] = {
    "default": lambda c, p: score(c.text, p),
    "exact": lambda c, p: score(c.text, replace(p, verifier="exact")),
    "numeric": lambda c, p: score(c.text, replace(p, verifier="numeric")),
    "format": lambda c, p: float(
        c.finished and extract_answer(c.text, numeric=is_integer(p.answer)) is not None
    ),
    "math": lambda c, p: _math(c.text, p.answer),
}
"""Built-in verifiers by the name a `rewards` entry gives: `default` is the problem's own
(numeric for the generated families, exact for file families); `format` is 1.0 when the
model finished the completion and gave an answer of the reference's kind."""


@dataclass(frozen=True, slots=True)
class Reward:
    """One weighted term of a family's reward."""

    label: str
    """How errors name it: 'verifier exact' or 'tasks/sort_reward.py:score'."""
    weight: float
    verifier: str | None = None
    function: Callable[..., Any] | None = None


def parse_function(spec: str, key: str) -> tuple[str, str]:
    """'path/file.py:name' -> (path, name), or a one-line error naming `key`."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise StageError(f"{key}: expected 'path/to/file.py:function_name', got {spec!r}")
    return path, name


def check_function(spec: str, key: str) -> str:
    """The reward file of `spec` if it exists and defines `name` at its top level, read
    without running it (at DAG time: the user's code runs only in the stage)."""
    path, name = parse_function(spec, key)
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except FileNotFoundError:
        raise StageError(f"config: {key}: no such reward file {path!r}") from None
    except (OSError, SyntaxError, ValueError) as err:
        line = f" line {err.lineno}" if isinstance(err, SyntaxError) else ""
        raise StageError(
            f"config: {key}: cannot read reward file {path!r}{line} ({getattr(err, 'msg', err)})"
        ) from None
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    defined |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    defined |= {
        (a.asname or a.name).split(".")[0]
        for n in tree.body
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }  # a function imported from elsewhere: `from mylib import score`
    if name not in defined:
        shown = ", ".join(sorted(defined)) or "none"
        raise StageError(
            f"config: {key}: {path} defines no function {name!r} (its top-level names: {shown})"
        )
    return path


@cache
def _module(path: str) -> Any:
    """The reward file imported once per process, under a name of its own."""
    resolved = Path(path).resolve()
    name = "stagetrain_reward_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise StageError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise StageError(f"{path}: no such reward file") from None
    except Exception as err:
        del sys.modules[name]
        raise StageError(f"{path}: importing the reward file failed ({_one_line(err)})") from None
    return module


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """The user's reward function of 'file.py:name', imported."""
    path, name = parse_function(spec, key)
    function = getattr(_module(path), name, None)
    if not callable(function):
        raise StageError(f"{key}: {path} has no function {name!r}")
    return function


def build(entries: Sequence[RewardSpec] | None, key: str) -> tuple[Reward, ...]:
    """The rewards of one family's `rewards` list (None: its problems' own verifier)."""
    if not entries:
        return (Reward(label="verifier default", weight=1.0, verifier="default"),)
    out = []
    for i, entry in enumerate(entries):
        if "function" in entry:
            out.append(Reward(label=entry["function"], weight=entry["weight"],
                              function=load_function(entry["function"], f"{key}.{i}.function")))  # fmt: skip
        else:
            out.append(Reward(label=f"verifier {entry['verifier']}", weight=entry["weight"],
                              verifier=entry["verifier"]))  # fmt: skip
    return tuple(out)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _row(problem: Problem) -> str:
    where = f" ({problem.origin})" if problem.origin else ""
    return f"row{where} with prompt {problem.question[:60]!r}"


def _call(
    reward: Reward, problems: Sequence[Problem], completions: Sequence[Completion]
) -> list[Any]:
    columns = sorted({c for p in problems for c in p.columns})
    kwargs = {
        "answer": [p.answer for p in problems], "level": [p.level for p in problems],
        "finished": [c.finished for c in completions], "completion_ids": [c.ids for c in completions],
        **{c: [p.columns.get(c) for p in problems] for c in columns},
    }  # fmt: skip
    assert reward.function is not None
    return reward.function([p.question for p in problems], [c.text for c in completions], **kwargs)


def values(
    reward: Reward, problems: Sequence[Problem], completions: Sequence[Completion]
) -> list[float | None]:
    """One term's value of each row: a verifier's, or the user function's, checked."""
    if reward.verifier is not None:
        return [
            VERIFIERS[reward.verifier](c, p) for c, p in zip(completions, problems, strict=True)
        ]
    try:
        out = _call(reward, problems, completions)
    except Exception as err:
        for i in range(len(problems)):  # the first row that raises on its own, to name it
            try:
                _call(reward, problems[i : i + 1], completions[i : i + 1])
            except Exception as row_err:
                raise StageError(
                    f"reward {reward.label}: raised {_one_line(row_err)} on the {_row(problems[i])}"
                ) from None
        raise StageError(
            f"reward {reward.label}: raised {_one_line(err)} on a batch of {len(problems)} rows"
        ) from None
    try:
        out = list(out)
    except TypeError:
        raise StageError(
            f"reward {reward.label}: returned {type(out).__name__}, expected a list of floats or None"
        ) from None
    if len(out) != len(problems):
        raise StageError(
            f"reward {reward.label}: returned {len(out)} values for {len(problems)} completions"
        )
    checked: list[float | None] = []
    for value, problem in zip(out, problems, strict=True):
        if value is not None and (not isinstance(value, numbers.Real) or not math.isfinite(value)):
            raise StageError(
                f"reward {reward.label}: returned {value!r} on the {_row(problem)}; expected a finite number or None"
            )
        checked.append(None if value is None else float(value))
    return checked


def weighted(
    rewards: Sequence[Reward], problems: Sequence[Problem], completions: Sequence[Completion]
) -> list[float]:
    """sum(weight * value) of each row over the terms that apply to it (0.0 where none does)."""
    total = [0.0] * len(problems)
    for reward in rewards:
        for i, value in enumerate(values(reward, problems, completions)):
            if value is not None:
                total[i] += reward.weight * value
    return total
