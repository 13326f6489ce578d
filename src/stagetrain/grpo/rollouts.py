"""Rollouts: completions of each prompt, their rewards and per-token advantages.

flat   group_size samples per prompt, the rank's prompts in one `generate` call
       (KV cache; in chunks if the plan's generation batch is smaller), and the
       group advantage (r - mean) / (std + eps) on every token.
tree   a search tree per prompt (`grpo.tree`): UCT selects a partial completion,
       `generate` samples `branching` continuations of `segment_tokens` tokens
       from it (prefix shared), finished leaves are scored by the verifier and
       their rewards backed up, until group_size leaves or the token budget.
       The trees of the rank's prompts grow together: one `generate` call per
       round for the node each open tree selected (left-padded, KV cache; in
       chunks of at most the generation batch's sequences). The KV cache of
       every open node is kept between rounds (`grpo/prefix_cache.py`), so a round
       prefills one token per sequence, not prompt and prefix again.
       Token advantages: the segment's value among its siblings plus the leaf's
       group advantage (`grpo.advantages.tree_token_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from stagetrain.grpo.advantages import group_advantages, tree_token_advantages
from stagetrain.grpo.prefix_cache import PrefixCache
from stagetrain.grpo.sampling import Sampled, generate, generation_kwargs, stream_seed
from stagetrain.grpo.tree import (
    Node,
    Request,
    SearchTree,
    TreeConfig,
    flat_equivalent_tokens,
    search_trees,
    segments,
    through_eos,
)
from stagetrain.training.experts import Routing


@dataclass(kw_only=True)
class Group:
    """One prompt's completions with their rewards and token advantages."""

    prompt: list[int]
    completions: list[list[int]]
    rewards: list[float]
    advantages: list[torch.Tensor]
    """Per completion, one advantage per completion token."""
    generated_tokens: int
    flat_tokens: int
    nodes: int
    """Tree nodes below the root (flat: one per completion)."""
    sampler_logprobs: list[list[float]] = field(default_factory=list)
    """Per completion, the sampler's log-prob of each token (`sampling.Sampled`; NaN for a
    token it did not draw), which the step compares with the trainer's."""
    sampler_routing: list[torch.Tensor] = field(default_factory=list)
    """Per completion of an MoE policy's rollouts, the experts chosen where each token was drawn
    (`sampling.Sampled.routing`; -1 for a tree's stand-in eos, which was not drawn), which the
    step compares with the trainer's; else empty."""

    @property
    def varies(self) -> bool:
        """Whether the rewards differ (a group that does not carries no signal)."""
        return len(set(self.rewards)) > 1


def sample(
    model: PreTrainedModel,
    prefixes: Sequence[list[int]],
    keys: Sequence[object],
    n: int,
    max_new_tokens: int,
    *,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    routing: Routing | None = None,
) -> Sampled:
    """n sampled continuations of each prefix (left-padded batch, KV cache), in prefix order,
    with their tokens' log-probs (and with `routing`, their experts); continuation j of the
    prefix with key k is drawn from the generator `stream_seed(k, j)`. Each prefix is
    prefilled once and its cache repeated to its n rows (`PrefixCache`, keeping nothing)."""
    generation = generation_kwargs(temperature, top_p, eos_id, pad_id)
    seeds = [stream_seed(key, j) for key in keys for j in range(n)]
    return PrefixCache(model).sample(prefixes, n, max_new_tokens, [0] * len(prefixes), generation,
                                     seeds=seeds, routing=routing)  # fmt: skip


def flat_groups(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    score: Callable[[int, list[int]], float],
    *,
    keys: Sequence[object],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    max_batch: int,
    routing: Routing | None = None,
) -> list[Group]:
    """group_size samples per prompt, at most `max_batch` sequences per `generate` call (the
    plan's generation batch, whose KV cache it counted); group advantages on every token.
    `keys` name the prompts' sampling streams (`sample`): the same key, the same completions.
    With `routing` (an MoE policy's) each group holds the sampler's routing too."""
    per_call = max(1, max_batch // group_size)
    completions: list[list[int]] = []
    logprobs: list[list[float]] = []
    routed: list[torch.Tensor] = []
    for at in range(0, len(prompts), per_call):
        out = sample(model, prompts[at : at + per_call], keys[at : at + per_call], group_size, max_new_tokens,
                     temperature=temperature, top_p=top_p, eos_id=eos_id, pad_id=pad_id, routing=routing)  # fmt: skip
        completions += out.tokens
        logprobs += out.logprobs
        routed += out.routing or []
    groups = []
    for i, prompt in enumerate(prompts):
        mine = completions[i * group_size : (i + 1) * group_size]
        rewards = [score(i, c) for c in mine]
        adv, _ = group_advantages(torch.tensor([rewards], dtype=torch.float32))
        tokens = sum(len(c) for c in mine)
        groups.append(
            Group(prompt=prompt, completions=mine, rewards=rewards, generated_tokens=tokens, flat_tokens=tokens, nodes=len(mine),
                  advantages=[torch.full((len(c),), float(a)) for c, a in zip(mine, adv[0], strict=True)],
                  sampler_logprobs=logprobs[i * group_size : (i + 1) * group_size],
                  sampler_routing=routed[i * group_size : (i + 1) * group_size])
        )  # fmt: skip
    return groups


def tree_groups(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    score: Callable[[int, list[int]], float],
    cfg: TreeConfig,
    *,
    keys: Sequence[object],
    temperature: float,
    top_p: float,
    pad_id: int,
    max_batch: int,
    budgets: Sequence[int] | None = None,
    greedy: bool = False,
    routing: Routing | None = None,
) -> list[Group]:
    """A search tree per prompt, all grown together (`tree.search_trees`): each round's
    selected nodes of every tree are expanded in one `generate` call of at most `max_batch`
    sequences; each tree's finished leaves are its group. `budgets`, if given, replaces
    `cfg.max_tokens` per prompt (the benchmark gives each tree flat sampling's tokens).
    `cfg.prefix_cache` keeps the KV cache of each open node between rounds (`PrefixCache`).
    `keys` name the prompts' sampling streams: a tree's e-th expansion samples continuation j
    from `stream_seed(key, e, j)`, so a tree grows the same whatever shares its batch.
    With `routing` (an MoE policy's) each group holds the sampler's routing of its leaves' tokens
    too. `greedy` is for tests."""
    if budgets is None:
        cfgs = [cfg] * len(prompts)
    else:
        cfgs = [replace(cfg, max_tokens=max(1, b)) for b in budgets]
    generation = generation_kwargs(temperature, top_p, cfg.eos_id, pad_id, greedy)
    store = PrefixCache(model) if cfg.prefix_cache else None
    expansions = [0] * len(prompts)
    # (tree, a node's completion) -> the sampler's log-probs (and experts) of the node's own tokens
    drawn: dict[tuple[int, tuple[int, ...]], list[float]] = {}
    routed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def expand(requests: list[Request], n: int, k: int) -> list[list[int]]:
        sequences = [list(prompts[r.tree]) + r.prefix for r in requests]
        seeds = []
        for r in requests:
            seeds += [stream_seed(keys[r.tree], expansions[r.tree], j) for j in range(n)]
            expansions[r.tree] += 1
        if store is None:
            out = generate(model, sequences, n, k, generation, branch_entropy=cfg.branch_entropy,
                           seeds=seeds, routing=routing)  # fmt: skip
        else:
            out = store.sample(sequences, n, k, [r.limit for r in requests], generation,
                               cfg.branch_entropy, seeds, routing)  # fmt: skip
        for j, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
            r = requests[j // n]
            node = through_eos(tokens, cfg.eos_id)[: r.limit]  # the child `search_trees` adds
            if node:
                drawn[r.tree, tuple(r.prefix + node)] = logprobs[: len(node)]
                if out.routing is not None:
                    routed[r.tree, tuple(r.prefix + node)] = out.routing[j][: len(node)]
        # A sampled pad token ends a completion as flat sampling's cut does; a segment needs a
        # token, so one that starts with pad is an eos (the completion ends there).
        return [c or [cfg.eos_id] for c in out.tokens]

    trees = search_trees(cfgs, expand, score, max_batch)
    like = next(iter(routed.values()), None)  # any drawn segment's (tokens, layers, top_k)

    # What the sampler recorded of a node's own tokens, given the tree, the node's completion and
    # its length; for the eos put in for an empty continuation, not drawn: NaN and experts -1.
    def logprobs_of(i: int, path: tuple[int, ...], length: int) -> list[float]:
        found = drawn.get((i, path))
        return [float("nan")] * length if found is None else found

    def routing_of(i: int, path: tuple[int, ...], length: int) -> torch.Tensor:
        found = routed.get((i, path))
        assert like is not None  # asked for only where the sampler recorded routing
        return like.new_full((length, *like.shape[1:]), -1) if found is None else found

    return [
        _tree_group(prompt, tree, partial(logprobs_of, i),
                    None if like is None else partial(routing_of, i))
        for i, (prompt, tree) in enumerate(zip(prompts, trees, strict=True))
    ]  # fmt: skip


Recorded = Callable[[tuple[int, ...], int], Any]
"""What the sampler recorded of a tree node's own tokens, by the node's completion and length."""


def _tree_group(
    prompt: list[int], tree: SearchTree, drawn: Recorded, routed: Recorded | None = None
) -> Group:
    """A tree's finished leaves as a group, with per-segment token advantages, the sampler's
    log-probs of each leaf's tokens (`drawn`) and, with `routed`, their experts."""
    rows, _ = segments(tree)
    per_leaf = tree_token_advantages(rows)
    leaves = tree.leaves()

    def along(leaf: Node, recorded: Recorded) -> list[Any]:
        """Each node's record from the root's child to `leaf`."""
        nodes = [tree.nodes[i] for i in tree.path(leaf)]
        return [recorded(tuple(tree.completion(n)), len(n.tokens)) for n in nodes]

    return Group(
        prompt=prompt,
        completions=[tree.completion(leaf) for leaf in leaves],
        rewards=[leaf.value for leaf in leaves],
        advantages=[per_leaf[leaf.id] for leaf in leaves],
        generated_tokens=tree.generated_tokens,
        flat_tokens=flat_equivalent_tokens(tree),
        nodes=len(tree.nodes) - 1,
        sampler_routing=[torch.cat(along(leaf, routed)) for leaf in leaves] if routed else [],
        sampler_logprobs=[sum(along(leaf, drawn), []) for leaf in leaves],
    )
