"""The tree's prefix KV cache (grpo.prefix_cache) on a real tiny Llama: the same tokens as
without it, and far fewer positions fed to the model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness.models import tiny_llama
from transformers import LlamaForCausalLM

from stagetrain.grpo.rollouts import Group, tree_groups
from stagetrain.grpo.sampling import branch_cut
from stagetrain.grpo.tree import TreeConfig

PROMPTS = [[3, 4], [5, 6, 7, 8, 9], [8], [9, 10, 11]]
"""Different lengths, so rows are left-padded; [8] has no cached position at first."""


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny matrices: two threads waiting on each other on a busy 2-core machine made these
    tests 20x slower (1 s against 20 s each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _groups(
    model: LlamaForCausalLM, *, reuse_cache: bool, greedy: bool, entropy: float = 0.0
) -> list[Group]:
    cfg = TreeConfig(branching=2, segment_tokens=3, max_leaves=8, max_tokens=60, max_new_tokens=12,
                     uct_c=1.0, eos_id=1, branch_entropy=entropy, prefix_cache=reuse_cache)  # fmt: skip
    with torch.no_grad():
        return tree_groups(model, PROMPTS, lambda i, c: float(sum(c) % 2), cfg, keys=range(len(PROMPTS)), temperature=1.0,
                           top_p=0.9, pad_id=0, max_batch=6, greedy=greedy)  # fmt: skip


def _trees(
    model: LlamaForCausalLM, *, reuse_cache: bool, greedy: bool, entropy: float = 0.0
) -> list[list[list[int]]]:
    return [
        g.completions
        for g in _groups(model, reuse_cache=reuse_cache, greedy=greedy, entropy=entropy)
    ]


@pytest.mark.parametrize("greedy", [True, False])
def test_trees_with_the_prefix_cache_generate_the_same_tokens(greedy: bool) -> None:
    model = tiny_llama()
    cached = _trees(model, reuse_cache=True, greedy=greedy)
    assert cached == _trees(model, reuse_cache=False, greedy=greedy)
    assert all(len(leaves) >= 2 for leaves in cached)
    assert max(len(leaf) for leaves in cached for leaf in leaves) > 3  # past the first segment


def test_the_prefix_cache_feeds_each_round_only_new_positions() -> None:
    model = tiny_llama()
    fed: dict[bool, list[int]] = {True: [], False: []}
    for reuse in (True, False):
        hook = model.model.register_forward_pre_hook(
            lambda _, args, kwargs, reuse=reuse: fed[reuse].append(kwargs["input_ids"].shape[1]),
            with_kwargs=True,
        )
        _trees(model, reuse_cache=reuse, greedy=False)
        hook.remove()
    # Uncached, each generate call's first forward feeds the longest prompt plus prefix; cached,
    # only the prompts' first round (and roots that widen) is prefilled, every call feeds one.
    assert max(fed[False]) > 5
    prefill: list[Any] = [width for width in fed[True] if width > 1]
    assert len(prefill) < len([w for w in fed[False] if w > 1]) / 2
    assert sum(fed[True]) < sum(fed[False])


def test_entropy_branching_ends_segments_before_uncertain_tokens() -> None:
    model = tiny_llama()
    fixed = _groups(model, reuse_cache=True, greedy=False)
    assert all(g.generated_tokens > g.nodes for g in fixed)  # segments of up to 3 tokens
    # Top-p leaves some steps a single token (no entropy): not every segment is one token long,
    # but many more segments for the tokens.
    eager = _groups(model, reuse_cache=True, greedy=False, entropy=1e-6)
    per_token = [
        sum(g.nodes for g in gs) / sum(g.generated_tokens for g in gs) for gs in (fixed, eager)
    ]
    assert per_token[1] > 1.3 * per_token[0]
    # A threshold no distribution reaches (64 tokens: at most ln 64 = 4.16 nats) is fixed segments.
    assert _trees(model, reuse_cache=True, greedy=False, entropy=5.0) == [
        g.completions for g in fixed
    ]
    assert _trees(model, reuse_cache=False, greedy=False, entropy=1.0) == _trees(
        model, reuse_cache=True, greedy=False, entropy=1.0
    )


def test_branch_cut_ends_a_row_before_its_first_uncertain_token_after_the_first() -> None:
    c, u = torch.tensor([10.0, -10.0, -10.0, -10.0]), torch.zeros(4)  # ~0 and ln 4 = 1.39 nats
    entropy = [[u, u, c, c], [c, c, c, c], [c, u, u, u], [u, c, c, u]]  # per row, per step
    scores = [torch.stack([row[step] for row in entropy]) for step in range(4)]
    rows = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6], [5, 6, 7, 8]]
    assert branch_cut(rows, scores, threshold=1.0) == [[5], [5, 6, 7, 8], [5], [5, 6, 7]]
    assert branch_cut(rows, scores, threshold=2.0) == rows
