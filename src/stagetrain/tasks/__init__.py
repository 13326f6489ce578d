"""Problems with checkable answers and difficulty levels, for pretraining and GRPO.

The same problems feed both stages: the pretraining corpus holds
`training_text(p)` for training-split problems, and GRPO prompts with `prompt(p)`
and rewards a completion with `score(completion, p)`. Every problem has a key;
its split (train 90%, val 5%, test 5%) is a hash of the key, so held-out
problems never appear in training, whoever generated them.

Modules: `problem` (the Problem dataclass, markers, splits), `arithmetic` and
`text` (the generated families), `registry` (families by name, reproducible
draws), `verify` (answer extraction and the verifiers), `families` (the config's
`tasks` section: the user's task files as families), `files` (their readers), `rewards`
(verifiers and user reward functions, weighted), `prompts` (rendering, chat templates).
"""

from stagetrain.tasks.problem import (
    ANSWER_TOKEN,
    PROBLEM_TOKEN,
    SPLITS,
    TASK_TOKENS,
    Problem,
    Split,
    prompt,
    split_of,
    training_text,
)
from stagetrain.tasks.registry import (
    FAMILIES,
    Family,
    get_family,
    heldout,
    known,
    problems,
    sample,
)
from stagetrain.tasks.verify import (
    EOS_TOKEN,
    VERIFIERS,
    extract_answer,
    normalise,
    score,
)

__all__ = [
    "ANSWER_TOKEN",
    "EOS_TOKEN",
    "FAMILIES",
    "PROBLEM_TOKEN",
    "SPLITS",
    "TASK_TOKENS",
    "VERIFIERS",
    "Family",
    "Problem",
    "Split",
    "extract_answer",
    "get_family",
    "heldout",
    "known",
    "normalise",
    "problems",
    "prompt",
    "sample",
    "score",
    "split_of",
    "training_text",
]
