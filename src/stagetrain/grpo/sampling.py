"""The rollouts' one sampler: a left-padded, KV-cached `generate` call and how its rows are cut.

Flat rollouts, tree rounds with and without the prefix cache all sample through `generate`
here, so they share the logits processors, the padding and the cut of each row (after the
first eos; at a sampled pad; for a tree with `branch_entropy`, before the first uncertain
token), and cached and uncached trees stay equal in distribution.

Each row samples from its own generator (`RowSampler`), seeded by the caller per prompt and
completion, not from torch's global one: a prompt's completions are then the same whichever
rank draws it and whatever else shares its batch, so a run resumed under another
data-parallel size samples what the uninterrupted run sampled. transformers' `generate` draws
every row from the global generator (`torch.multinomial`), hence the Gumbel-max processor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from transformers import Cache, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import TopPLogitsWarper


def generation_kwargs(
    temperature: float, top_p: float, eos_id: int, pad_id: int, greedy: bool = False
) -> dict:
    """`generate`'s arguments; `greedy` takes the most likely token (for tests), otherwise
    `generate` samples at this temperature and top-p from per-row generators."""
    tokens = {"eos_token_id": eos_id, "pad_token_id": pad_id}
    if greedy:
        return tokens
    return tokens | {"temperature": temperature, "top_p": top_p}


def stream_seed(*key: object) -> int:
    """A generator seed from a key such as (run seed, step, prompt, completion): stable across
    processes and Python versions (unlike `hash`)."""
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RowSampler(LogitsProcessor):
    """Sampling at a temperature and top-p by the Gumbel-max trick, with one generator per row.

    argmax(logits + Gumbel noise) is a draw from softmax(logits), so `generate` runs greedy
    and each row's noise comes from its own seeded generator. `warped` keeps each step's
    scores before the noise (what was sampled from), for the branch cut's entropy.
    """

    def __init__(self, temperature: float, top_p: float, seeds: Sequence[int]) -> None:
        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self.seeds = list(seeds)
        self.generators: list[torch.Generator] = []
        self.warped: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.seeds) != scores.shape[0]:
            raise ValueError(f"{len(self.seeds)} seeds for {scores.shape[0]} rows")
        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        self.warped.append(scores)
        if not self.generators:  # on the logits' device: a GPU draws its own noise
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device)
                               for g in self.generators])  # fmt: skip
        return scores - torch.log(-torch.log(uniform.clamp(min=1e-20)))


def generate(
    model: PreTrainedModel,
    sequences: Sequence[list[int]],
    n: int,
    max_new_tokens: int,
    generation: dict,
    *,
    branch_entropy: float = 0.0,
    cache: Cache | None = None,
    seeds: Sequence[int] = (),
) -> list[list[int]]:
    """n continuations of each sequence, in sequence order, each cut by `cut` and, when
    `branch_entropy` > 0, by `branch_cut`. `cache`, if given, holds every row's keys and values
    of all its tokens but the last, left-padded like the rows (`PrefixCache`). When `generation`
    samples, `seeds` has one generator seed per continuation, in the same order."""
    width = max(len(s) for s in sequences)
    pad = generation["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    device = next(model.parameters()).device
    extra = {} if cache is None else {"cache": cache}
    generation = dict(generation)
    sampler = None
    if "temperature" in generation:
        if len(seeds) != len(sequences) * n:
            raise ValueError(f"{len(seeds)} seeds for {len(sequences) * n} continuations")
        sampler = RowSampler(generation.pop("temperature"), generation.pop("top_p"), seeds)
        extra["logits_processor"] = LogitsProcessorList([sampler])
    if branch_entropy:
        extra |= {"return_dict_in_generate": True, "output_scores": True}
    out = model.generate(
        # Rows repeated here, as num_return_sequences would (greedy refuses it), so n = B works greedy.
        input_ids=ids.repeat_interleave(n, 0).to(device), attention_mask=mask.repeat_interleave(n, 0).to(device),
        max_new_tokens=max_new_tokens, use_cache=True, do_sample=False, **generation, **extra,
        # Parameters are gathered and ZeRO-3's hooks are off (grpo.train.gathered): each rank
        # generates alone. transformers would otherwise keep ranks in lockstep under ZeRO-3,
        # which deadlocks when ranks make different numbers of generate calls (tree search).
        synced_gpus=False,
    )  # fmt: skip
    tokens = out.sequences if branch_entropy else out
    rows = [cut(row[width:].tolist(), generation["eos_token_id"], pad) for row in tokens]
    if not branch_entropy:
        return rows
    return branch_cut(rows, sampler.warped if sampler else out.scores, branch_entropy)


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
    was sampled from, `RowSampler.warped`)."""
    logp = torch.stack([s.float() for s in scores], 1).log_softmax(-1)  # [rows, steps, vocab]
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    out = []
    for row, h in zip(rows, entropy.tolist(), strict=True):
        uncertain = [i for i in range(1, len(row)) if h[i] > threshold]
        out.append(row[: uncertain[0]] if uncertain else row)
    return out
