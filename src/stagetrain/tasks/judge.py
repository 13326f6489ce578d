"""Prompts and rewards together: what GRPO and the held-out evaluation ask of the task library.

One object so that training and evaluation cannot drift apart: the rollouts and the
greedy evaluation render prompts with the same `Prompter`, and score completions with
the same family rewards and the same `success_at`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetrain.tasks.families import TaskSet
from stagetrain.tasks.problem import Problem
from stagetrain.tasks.prompts import Prompter
from stagetrain.tasks.rewards import Context, TrainerState, weighted


class Judge:
    """Prompt ids, weighted rewards and success of problems of a `TaskSet`, for one tokenizer."""

    def __init__(self, tasks: TaskSet, tokenizer: Any, *, max_prompt_len: int) -> None:
        self.tasks = tasks
        self.prompter = Prompter(tokenizer, chat_template=tasks.chat_template, limit=max_prompt_len)
        self.context = Context()
        """What reward functions get as `trainer_state`, `log_extra` and `log_metric`."""

    def at_step(self, step: int, max_steps: int) -> None:
        """The optimizer steps done when the next rewards are scored, of the run's `max_steps`
        (TRL's `trainer_state`: 0 while the first step's completions are scored)."""
        self.context.state = TrainerState(global_step=step, max_steps=max_steps)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The prompt's token ids as the model is given them."""
        return self.prompter.ids(problem)

    def rewards(
        self, problems: Sequence[Problem], completions: Sequence[Sequence[int]]
    ) -> list[float]:
        """The weighted reward of each completion (token ids) of its problem; each family's
        rows are scored in one call of each of its reward functions."""
        decoded = [self.prompter.completion(ids) for ids in completions]
        out = [0.0] * len(problems)
        for family in dict.fromkeys(p.family for p in problems):
            rows = [i for i, p in enumerate(problems) if p.family == family]
            scores = weighted(self.tasks.rewards(family), [problems[i] for i in rows],
                              [decoded[i] for i in rows], self.context)  # fmt: skip
            for i, value in zip(rows, scores, strict=True):
                out[i] = value
        return out

    def solved(self, problem: Problem, reward: float) -> bool:
        """Whether a completion with this reward solves its problem (`tasks.success_at`)."""
        return reward >= self.tasks.success_at(problem.family)
