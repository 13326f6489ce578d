"""A task family's reward: built-in verifiers and the user's Python functions, weighted.

A user function is called exactly as TRL's GRPOTrainer calls one, by keyword only, so a
reward written for TRL (its shipped `trl.rewards` included) runs here unchanged:

- `prompts`: the questions (the dataset's prompt column), `completions`: the model's text,
  decoded up to its end token (eos, or the model starting a new problem), without it; for a
  conversational problem (its prompt a list of messages) the prompt is its messages and the
  completion `[{"role": "assistant", "content": text}]`, as TRL passes them;
- `completion_ids`, `trainer_state` (`global_step`, `max_steps`), `log_extra(column,
  values)`, `log_metric(name, value)`, and stagetrain's own `answer` (the reference, as
  text), `level` and `finished` (the model ended the completion itself, within
  grpo.max_new_tokens): one entry per row where a list;
- every column of the family's files under its own name, mapped ones included (a `solution`
  column mapped as the answer still reaches `accuracy_reward` as `solution`), each call a
  fresh copy, so a function that edits its arguments cannot change the stored problems.

An async function is awaited. `None` means "not applicable to this row" (as in TRL): the
row's weighted sum leaves that function out, and a row no function applies to scores 0. The
reward of a completion is sum(weight * value), which must stay finite. A reward file is the
user's own code, imported and run in every GRPO rank for that rank's completions (each rank
scores what it sampled, so no rank waits on another's scoring and nothing is sent between
them) and by `stagetrain.evaluate`.

A user function that raises (anything, SystemExit included), returns the wrong number of
values, or a value that is not a finite number or None is bad input: the stage stops with
one line naming the function and the first bad row, before the step's update is applied.
Built-in verifiers never raise (`verify.score`): one odd completion must not stop a run.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stagetrain.config.settings import RewardSpec
from stagetrain.errors import StageError
from stagetrain.tasks.problem import Problem
from stagetrain.tasks.reward_source import (  # noqa: F401 (re-exported: the tasks API)
    KEYWORDS,
    _module,
    check_function,
    load_function,
    one_line,
    parse_function,
)
from stagetrain.tasks.verify import extract_answer, is_integer, score

RESERVED = KEYWORDS
"""The keyword names every reward call passes; a dataset column may not take one of them."""


@dataclass(frozen=True, slots=True)
class TrainerState:
    """TRL's `trainer_state` as rewards read it, for shaping by progress: the GRPO step being
    scored (0 outside training: the held-out evaluation) and the run's last step."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class RewardLog:
    """Where `log_extra` and `log_metric` put what a reward function logs (TRL's signatures)."""

    extra: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """Extra per-completion values of a column."""
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """One scalar of a batch, under `name`."""
        self.metrics[name].append(value)


@dataclass
class Context:
    """What a reward call passes beside the rows: the trainer's state and the log sinks; and
    each term's unweighted values as scored (`weighted` appends, NaN where a term gave None),
    for the per-reward metrics TRL logs as rewards/<name>/mean and std."""

    state: TrainerState = field(default_factory=TrainerState)
    log: RewardLog = field(default_factory=RewardLog)
    terms: list[tuple[str, float]] = field(default_factory=list)


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
    name: str
    """How metrics name it, as TRL does: the function's `__name__` (a factory's product's), or
    the verifier's name."""
    weight: float
    verifier: str | None = None
    function: Callable[..., Any] | None = None


def build(entries: Sequence[RewardSpec] | None, key: str) -> tuple[Reward, ...]:
    """The rewards of one family's `rewards` list (None: its problems' own verifier)."""
    if not entries:
        return (Reward(label="verifier default", name="verifier", weight=1.0, verifier="default"),)
    out = []
    for i, entry in enumerate(entries):
        if "function" in entry:
            kwargs = entry.get("kwargs")
            function = load_function(entry["function"], f"{key}.{i}.function", kwargs)
            name = getattr(function, "__name__", type(function).__name__)
            out.append(
                Reward(
                    label=entry["function"], name=name, weight=entry["weight"], function=function
                )
            )
        else:
            out.append(Reward(label=f"verifier {entry['verifier']}", name=entry["verifier"], weight=entry["weight"],
                              verifier=entry["verifier"]))  # fmt: skip
    return tuple(out)


def _row(problem: Problem) -> str:
    where = f" ({problem.origin})" if problem.origin else ""
    return f"row{where} with prompt {problem.question[:60]!r}"


async def _awaited(pending: Awaitable[Any]) -> Any:
    return await pending


def _call(
    reward: Reward, problems: Sequence[Problem], completions: Sequence[Completion], context: Context
) -> list[Any]:
    """One call of the user's function, as TRL makes it: keywords only, columns copied."""
    columns = sorted({c for p in problems for c in p.columns})
    kwargs = {
        "prompts": [p.question if p.messages is None else [dict(m) for m in p.messages] for p in problems],
        "completions": [c.text if p.messages is None else [{"role": "assistant", "content": c.text}]
                        for p, c in zip(problems, completions, strict=True)],
        "completion_ids": [list(c.ids) for c in completions],
        "trainer_state": context.state, "log_extra": context.log.log_extra, "log_metric": context.log.log_metric,
        "answer": [p.answer for p in problems], "level": [p.level for p in problems],
        "finished": [c.finished for c in completions],
        **{c: [copy.deepcopy(p.columns.get(c)) for p in problems] for c in columns},
    }  # fmt: skip
    assert reward.function is not None
    out = reward.function(**kwargs)
    return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out


def _first_failure(
    reward: Reward,
    problems: Sequence[Problem],
    completions: Sequence[Completion],
    context: Context,
    err: BaseException,
) -> StageError:
    """The batch's error as one line, naming the first row that raises on its own."""
    for i in range(len(problems)):
        try:
            _call(reward, problems[i : i + 1], completions[i : i + 1], context)
        except BaseException as row_err:  # noqa: BLE001 (SystemExit from user code is bad input too)
            return StageError(
                f"reward {reward.label}: raised {one_line(row_err)} on the {_row(problems[i])}"
            )
    return StageError(
        f"reward {reward.label}: raised {one_line(err)} on a batch of {len(problems)} rows"
    )


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None where it is not a number or not finite as a float
    (an int too large for one raises OverflowError)."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


def values(
    reward: Reward,
    problems: Sequence[Problem],
    completions: Sequence[Completion],
    context: Context | None = None,
) -> list[float | None]:
    """One term's value of each row: a verifier's, or the user function's, checked."""
    if reward.verifier is not None:
        return [
            VERIFIERS[reward.verifier](c, p) for c, p in zip(completions, problems, strict=True)
        ]
    context = context or Context()
    try:
        out = _call(reward, problems, completions, context)
    except BaseException as err:  # noqa: BLE001 (SystemExit from user code is bad input too)
        raise _first_failure(reward, problems, completions, context, err) from None
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
        number = None if value is None else _finite(value)
        if value is not None and number is None:
            raise StageError(
                f"reward {reward.label}: returned {_shown(value)} on the {_row(problem)}; expected a finite number or None"
            )
        checked.append(number)
    return checked


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def weighted(
    rewards: Sequence[Reward],
    problems: Sequence[Problem],
    completions: Sequence[Completion],
    context: Context | None = None,
) -> list[float]:
    """sum(weight * value) of each row over the terms that apply to it (0.0 where none does),
    refused where it is not finite (two weights of 1e308 overflow to inf)."""
    total = [0.0] * len(problems)
    for reward in rewards:
        for i, value in enumerate(values(reward, problems, completions, context)):
            if context is not None:
                context.terms.append((reward.name, math.nan if value is None else value))
            if value is not None:
                total[i] += reward.weight * value
                if not math.isfinite(total[i]):
                    raise StageError(
                        f"reward {reward.label}: weight {reward.weight!r} x {value!r} makes the reward of the "
                        f"{_row(problems[i])} {total[i]}; expected a finite sum (lower the weights)"
                    )
    return total
