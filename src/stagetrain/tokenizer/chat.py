"""The trained tokenizer's chat template, its own module so that prompt rendering can tell it
from a chat model's without importing the tokenizer libraries."""

from __future__ import annotations

from stagetrain.tasks.problem import ANSWER_TOKEN, PROBLEM_TOKEN

EOS_TOKEN = "<|eos|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    f"{{% if m['role'] == 'user' %}}{PROBLEM_TOKEN}{{{{ m['content'] }}}}{ANSWER_TOKEN}"
    f"{{% elif m['role'] == 'assistant' %}}{{{{ m['content'] }}}}{EOS_TOKEN}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
"""The trained tokenizer's chat template: a user message is the pipeline's own prompt markup,
`<|problem|>question<|answer|>` (the generation prompt is already its end), an assistant's is
its text and eos, a system message its text. So `apply_chat_template` of one user message
gives exactly the prompt the corpus taught, and a consolidated model folder (which copies the
tokenizer) is prompted right by plain transformers and by TRL's conversational datasets."""
