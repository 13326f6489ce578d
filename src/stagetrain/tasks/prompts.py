"""What the model is shown for a problem, and what rewards are shown of its answer.

Without a chat template a prompt is the pipeline's own markup,
`<|problem|>question<|answer|>`, which the generated corpus teaches. When the tokenizer
has a chat template (the pipeline's trained tokenizer's renders that same markup; an
`init_from` chat model's, or `tokenizer.source: pretrained`) and `tasks.chat_template` is
true, the question is the user turn of a conversation rendered by
`apply_chat_template(..., add_generation_prompt=True)`, token for token as the model was
tuned to read it. A conversational family's prompts (lists of messages, as TRL's datasets
hold them) are always rendered so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetrain.errors import StageError
from stagetrain.tasks.problem import PROBLEM_TOKEN, Problem, prompt
from stagetrain.tasks.rewards import Completion
from stagetrain.tokenizer.chat import CHAT_TEMPLATE


class Prompter:
    """Prompt token ids of problems for one tokenizer, and completions decoded for rewards."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, limit: int) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        # The trained tokenizer's own template renders the plain markup: no chat, as before it had one.
        self.chat = bool(chat_template and template and template != CHAT_TEMPLATE)
        self.limit = limit
        """grpo.max_prompt_len: the prompt tokens the plan counted."""
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(PROBLEM_TOKEN)}
        self.stops = stops - {None, tokenizer.unk_token_id}

    def full(self, problem: Problem) -> list[int]:
        """The whole rendered prompt: a conversational problem's messages always through the
        chat template (as TRL's `maybe_apply_chat_template`), a plain question where `chat`."""
        if problem.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise StageError(f"{problem.origin or problem.family}: a conversational prompt (a list of messages) "
                                 "needs a tokenizer with a chat template; this one has none")  # fmt: skip
            return self._rendered([dict(m) for m in problem.messages])
        if self.chat:
            return self._rendered([{"role": "user", "content": problem.question}])
        return self.tokenizer(prompt(problem), add_special_tokens=False)["input_ids"]

    def _rendered(self, messages: list[dict[str, str]]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    def ids(self, problem: Problem) -> list[int]:
        """The prompt as the model is given it, refused when longer than `limit`: cut, it would
        ask another question than the one its reward checks ("Which is smaller: 705 or 272?"
        cut to six tokens was " 272?"). `check_lengths` runs first, before any step."""
        ids = self.full(problem)
        if len(ids) > self.limit:
            where, fix = problem.origin, "shorten the prompt"
            if not where:  # a generated problem: its level decides its length
                where = f"{problem.family} level {problem.level}"
                fix = f"keep the curriculum below level {problem.level} (grpo.curriculum.max_level)"
            raise StageError(f"{where}: its prompt is {len(ids)} tokens{' with the chat template' if self.chat else ''}, "
                             f"more than grpo.max_prompt_len ({self.limit}); raise it or {fix}")  # fmt: skip
        return ids

    def check_lengths(self, problems: Sequence[Problem]) -> None:
        """`ids`' refusal for each of `problems`, before the first step."""
        for problem in problems:
            self.ids(problem)

    def completion(self, ids: Sequence[int]) -> Completion:
        """A completion's tokens up to its end (eos, or a new problem begun), decoded."""
        ids = list(ids)
        end = next((i for i, t in enumerate(ids) if t in self.stops), None)
        kept = ids if end is None else ids[:end]
        text = self.tokenizer.decode(kept, skip_special_tokens=False)
        return Completion(text=text, finished=end is not None, ids=kept)
