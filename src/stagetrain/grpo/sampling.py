"""The rollouts' one sampler: a left-padded, KV-cached `generate` call and how its rows are cut.

Flat rollouts, tree rounds with and without the prefix cache all sample through `generate`
here, so they share the logits processors, the padding and the cut of each row (after the
first eos; at a sampled pad; for a tree with `branch_entropy`, before the first uncertain
token), and cached and uncached trees stay equal in distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel


def generation_kwargs(
    temperature: float, top_p: float, eos_id: int, pad_id: int, greedy: bool = False
) -> dict:
    """`generate`'s sampling arguments; `greedy` takes the most likely token (for tests)."""
    tokens = {"eos_token_id": eos_id, "pad_token_id": pad_id}
    if greedy:
        return tokens | {"do_sample": False}
    return tokens | {"do_sample": True, "temperature": temperature, "top_p": top_p}


def generate(
    model: PreTrainedModel,
    sequences: Sequence[list[int]],
    n: int,
    max_new_tokens: int,
    generation: dict,
    *,
    branch_entropy: float = 0.0,
    cache: Cache | None = None,
) -> list[list[int]]:
    """n continuations of each sequence, in sequence order, each cut by `cut` and, when
    `branch_entropy` > 0, by `branch_cut`. `cache`, if given, holds every row's keys and values
    of all its tokens but the last, left-padded like the rows (`PrefixCache`)."""
    width = max(len(s) for s in sequences)
    pad = generation["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    device = next(model.parameters()).device
    extra = {} if cache is None else {"cache": cache}
    if branch_entropy:
        extra |= {"return_dict_in_generate": True, "output_scores": True}
    out = model.generate(
        # Rows repeated here, as num_return_sequences would (greedy refuses it), so n = B works greedy.
        input_ids=ids.repeat_interleave(n, 0).to(device), attention_mask=mask.repeat_interleave(n, 0).to(device),
        max_new_tokens=max_new_tokens, use_cache=True, **generation, **extra,
        # Parameters are gathered and ZeRO-3's hooks are off (grpo.train.gathered): each rank
        # generates alone. transformers would otherwise keep ranks in lockstep under ZeRO-3,
        # which deadlocks when ranks make different numbers of generate calls (tree search).
        synced_gpus=False,
    )  # fmt: skip
    tokens = out.sequences if branch_entropy else out
    rows = [cut(row[width:].tolist(), generation["eos_token_id"], pad) for row in tokens]
    return branch_cut(rows, out.scores, branch_entropy) if branch_entropy else rows


def cut(tokens: list[int], eos_id: int, pad_id: int) -> list[int]:
    """A sampled row's tokens up to and including the first eos, without padding."""
    out = []
    for token in tokens:
        if token == pad_id and token != eos_id:
            break
        out.append(token)
        if token == eos_id:
            break
    return out


def branch_cut(
    rows: list[list[int]], scores: Sequence[torch.Tensor], threshold: float
) -> list[list[int]]:
    """Each row up to its first token, after the first, drawn from a distribution whose
    entropy exceeds `threshold` nats: the tree branches there (TreeRL, ARPO). `scores` are
    `generate`'s processed logits per step (temperature and top-p applied: the entropy of what
    was sampled from)."""
    logp = torch.stack([s.float() for s in scores], 1).log_softmax(-1)  # [rows, steps, vocab]
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    out = []
    for row, h in zip(rows, entropy.tolist(), strict=True):
        uncertain = [i for i in range(1, len(row)) if h[i] > threshold]
        out.append(row[: uncertain[0]] if uncertain else row)
    return out
