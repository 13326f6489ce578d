"""A group's completions scored over one forward of their shared prompt.

A GRPO group is one prompt and its `group_size` completions. Scoring each (prompt, completion)
row in full runs the prompt through the model group_size times, and on the tasks GRPO trains
on, prompts are most of each row: the default run's are about 20 tokens against completions
of 3-8. So the trainer's forwards (and the reference's) run each distinct prompt once, keep
its keys and values, repeat them to the rows that share it, and run only the completions over
that cache. Gradients reach the prompt's positions through the repeated keys and values, as
they would through the rows' own.

The maths is the full-row forward's: each completion token attends to the same keys at the
same positions (the prompt's padding is masked, position ids continue each prompt's own
length). Only the order of float sums differs. On the default run's job spec in fp32, the
reference's forward and the trainer's forward and backward went from 0.268 to 0.163 s a step
(`python -m benchmarks.grpo_step`, docs/benchmarks.md).

transformers' own prefix sharing lives in `generate`; for a scoring forward with gradients
there is none to call, hence this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from stagetrain.errors import StageError
from stagetrain.grpo.sampling import cache_argument, left_padded

Items = Sequence[tuple[list[int], list[int]]]
"""(prompt, completion) token rows, the rows of one group next to each other."""


def applies(model: Any) -> bool:
    """Whether a forward of `model` keeps a cache it was handed. A transformers layer that
    checkpoints its activations drops the cache while a graph is built (the condition below is
    its own), and the completions would then be scored without their prompts."""
    if not torch.is_grad_enabled():
        return True
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    return not any(
        getattr(m, "gradient_checkpointing", False) and m.training for m in module.modules()
    )


def completion_logits(
    model: Any, items: Items, device: torch.device, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict each completion token, (B, C, V), and those tokens, (B, C), with
    C the longest completion; past a row's own completion, its tokens are `pad` (and their
    logits of no use). Two forwards: the distinct prompts, then the completions over their
    repeated cache."""
    prompts = list(dict.fromkeys(tuple(p) for p, _ in items))
    row_of = {p: i for i, p in enumerate(prompts)}
    which = torch.tensor([row_of[tuple(p)] for p, _ in items], device=device)
    # Left-padded, so that every prompt's last token, whose logits predict its completions'
    # first, is the last column: the LM head runs there alone (`logits_to_keep`), not over
    # every prompt position (prompts x length x vocabulary logits, gigabytes at a large vocab).
    ids, seen, at = left_padded(prompts, pad, device)
    width = ids.shape[1]
    cache, keyword = DynamicCache(), cache_argument(model)
    head = model(input_ids=ids, attention_mask=seen, position_ids=at, use_cache=True,
                 logits_to_keep=1, **{keyword: cache}).logits[:, -1]  # fmt: skip
    if cache.get_seq_length() != width:
        raise StageError(
            f"{type(getattr(model, 'module', model)).__name__} kept no cache of the prompts' forward "
            f"(passed as {keyword}=), so their completions cannot be scored over it: a transformers "
            "version that takes the cache under another keyword?"
        )
    repeated = DynamicCache(
        ddp_cache_data=[(k.index_select(0, which), v.index_select(0, which))
                        for k, v in ((layer.keys, layer.values) for layer in cache.layers)]
    )  # fmt: skip
    longest = max(len(c) for _, c in items)
    tokens = torch.tensor([c + [pad] * (longest - len(c)) for _, c in items], device=device)
    mask = torch.cat(
        [seen.index_select(0, which),
         torch.tensor([[1] * len(c) + [0] * (longest - len(c)) for _, c in items], device=device)],
        dim=1,
    )  # fmt: skip
    position = torch.tensor([[len(p) + j for j in range(longest)] for p, _ in items], device=device)
    tail = model(input_ids=tokens, attention_mask=mask, position_ids=position, use_cache=True,
                 **{keyword: repeated}).logits  # fmt: skip
    first = head[which].unsqueeze(1)  # the prompt's last position predicts token 0
    return torch.cat([first, tail[:, :-1]], dim=1), tokens


def spread(values: torch.Tensor, items: Items, width: int) -> torch.Tensor:
    """(B, C) per-completion-token values at the (B, width) columns of the full rows' layout,
    where the token at completion position j is predicted at column len(prompt) - 1 + j; 0
    elsewhere. Differentiable in `values`."""
    rows = torch.tensor([r for r, (_, c) in enumerate(items) for _ in c], device=values.device)
    source = torch.tensor([j for _, c in items for j in range(len(c))], device=values.device)
    column = torch.tensor([len(p) - 1 + j for p, c in items for j in range(len(c))],
                          device=values.device)  # fmt: skip
    out = values.new_zeros((len(items), width))
    return out.index_put((rows, column), values[rows, source])
