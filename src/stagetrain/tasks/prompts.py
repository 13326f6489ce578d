"""What the model is shown for a problem, and what rewards are shown of its answer.

Without a chat template a prompt is the pipeline's own markup,
`<|problem|>question<|answer|>`, which the generated corpus teaches. When the tokenizer
has a chat template (the pipeline's trained tokenizer's renders that same markup; an
`init_from` chat model's, or `tokenizer.source: pretrained`) and `tasks.chat_template` is
true, the question is the user turn of a conversation rendered by
`apply_chat_template(..., add_generation_prompt=True)`, token for token as the model was
tuned to read it. A conversational family's prompts (lists of messages, as TRL's datasets
hold them) are always rendered so. A template must render a probe question's text, or it is
refused: a template that ignores the messages turned every prompt into its own text.

Task text never becomes control tokens: a question or message holding any special token of
the tokenizer in use (a chat model's `<|im_start|>` as well as the pipeline's own) is
refused, since encoding would make it a real turn marker and let a row inject a system turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetrain.errors import StageError
from stagetrain.tasks.problem import CHAT_TEMPLATE, PROBLEM_TOKEN, Problem, prompt
from stagetrain.tasks.rewards import Completion

PROBE = "What is 2 plus 3?"
"""The user message a chat template must render, checked once per tokenizer."""


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """Every special token of `tokenizer`: its named ones (eos, pad, ...) and the added tokens
    it marks special (a chat model's turn markers), longest first."""
    named = set(getattr(tokenizer, "all_special_tokens", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    named |= {t.content for t in added if getattr(t, "special", False)}
    return tuple(sorted((t for t in named if t), key=lambda t: (-len(t), t)))


def _where(problem: Problem) -> str:
    """How errors name a problem: its file and row, or a generated one's family and level."""
    return problem.origin or f"{problem.family} level {problem.level}"


def stop_ids(tokenizer: Any) -> list[int]:
    """The token ids a completion ends at: eos, and the marker of a new problem begun (a model
    that learnt the corpus goes on to the next problem). The sampler stops at them, and so does a
    consolidated folder's generation_config.json, so that a plain `generate` stops where the
    pipeline does. A tokenizer without the marker (a pretrained one) has eos alone."""
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(PROBLEM_TOKEN)]
    return list(dict.fromkeys(s for s in stops if s is not None and s != tokenizer.unk_token_id))


def renders_chat(template: str | None, chat_template: bool) -> bool:
    """Whether prompts are chat turns: `tasks.chat_template` on and a tokenizer template other
    than the trained tokenizer's, which renders the plain markup (as before it had one)."""
    return bool(chat_template and template and template != CHAT_TEMPLATE)


class Prompter:
    """Prompt token ids of problems for one tokenizer, and completions decoded for rewards."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, limit: int) -> None:
        self.tokenizer = tokenizer
        self.chat = renders_chat(getattr(tokenizer, "chat_template", None), chat_template)
        self.limit = limit
        """grpo.max_prompt_len: the prompt tokens the plan counted."""
        self.stops = set(stop_ids(tokenizer))
        self.specials = special_tokens(tokenizer)
        self._probed = False
        if self.chat:
            self._probe_template()

    def _probe_template(self) -> None:
        """The chat template renders a user message's text, or one line naming the tokenizer;
        checked once, before the first prompt it renders."""
        self._probed = True
        folder = getattr(self.tokenizer, "name_or_path", "") or "the tokenizer"
        try:
            ids = self._rendered([{"role": "user", "content": PROBE}])
        except Exception as err:  # Jinja's errors, and whatever a template's own code raises
            text = str(err).strip().splitlines()
            raise StageError(f"{folder}: its chat template cannot render a conversation "
                             f"({type(err).__name__}: {text[0] if text else ''})") from None  # fmt: skip
        if PROBE not in self.tokenizer.decode(ids, skip_special_tokens=False):
            raise StageError(f"{folder}: its chat template does not render the messages' text (a user message "
                             f"{PROBE!r} is not in its output); fix it or set tasks.chat_template: false")  # fmt: skip

    def full(self, problem: Problem) -> list[int]:
        """The whole rendered prompt: a conversational problem's messages always through the
        chat template (as TRL's `maybe_apply_chat_template`), a plain question where `chat`."""
        texts = (
            [problem.question]
            if problem.messages is None
            else [m["content"] for m in problem.messages]
        )
        marker = next((t for t in self.specials for text in texts if t in text), None)
        if marker is not None:
            raise StageError(f"{_where(problem)}: the prompt contains {marker!r}, a special token of the tokenizer in use; "
                             "task text must not become control tokens")  # fmt: skip
        if problem.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise StageError(f"{_where(problem)}: a conversational prompt (a list of messages) "
                                 "needs a tokenizer with a chat template; this one has none")  # fmt: skip
            if not self._probed:
                self._probe_template()
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
            where, fix = _where(problem), "shorten the prompt"
            if not problem.origin:  # a generated problem: its level decides its length
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
