"""The rollouts' per-row sampling streams (grpo.sampling.RowSampler): draws from the tempered,
top-p distribution, and a prompt's completions that depend on its key only, not on the batch it
shares or the rank that draws it (what lets GRPO resume under another data-parallel size)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from harness.models import tiny_llama
from transformers import LlamaForCausalLM

from stagetrain.grpo.rollouts import flat_groups, tree_groups
from stagetrain.grpo.sampling import RowSampler, stream_seed
from stagetrain.grpo.tree import TreeConfig

PROMPTS = [[3, 4], [5, 6, 7, 8, 9], [8], [9, 10, 11]]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_row_sampler_draws_from_the_tempered_top_p_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -3.0])
    rows = 4000
    sampler = RowSampler(0.7, 0.95, [stream_seed("t", i) for i in range(rows)])
    drawn = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, 4)).argmax(-1)
    freq = torch.bincount(drawn, minlength=4).double() / rows
    # top-p 0.95 of softmax(logits / 0.7) keeps the first three tokens (99.7% of the mass)
    # and drops the last; the kept ones renormalised.
    kept = torch.softmax(logits[:3].double() / 0.7, -1)
    se = (kept * (1 - kept) / rows).sqrt()
    assert freq[3] == 0
    assert ((freq[:3] - kept).abs() < 4 * se).all(), (freq, kept)
    assert torch.equal(sampler.warped[0][0, :3], logits[:3] / 0.7)  # what the entropy reads


def _flat(
    model: LlamaForCausalLM, which: list[int], max_batch: int, run: str = "run"
) -> list[list[list[int]]]:
    with torch.no_grad():
        groups = flat_groups(model, [PROMPTS[i] for i in which], lambda i, c: 0.0,
                             keys=[(run, i) for i in which], group_size=4, max_new_tokens=8,
                             temperature=1.0, top_p=0.9, eos_id=1, pad_id=0, max_batch=max_batch)  # fmt: skip
    return [g.completions for g in groups]


def _trees(
    model: LlamaForCausalLM, which: list[int], max_batch: int, run: str = "run"
) -> list[list[list[int]]]:
    cfg = TreeConfig(branching=2, segment_tokens=3, max_leaves=6, max_tokens=60, max_new_tokens=9,
                     uct_c=1.0, eos_id=1)  # fmt: skip
    with torch.no_grad():
        groups = tree_groups(model, [PROMPTS[i] for i in which], lambda i, c: float(sum(c) % 2),
                             cfg, keys=[(run, i) for i in which], temperature=1.0, top_p=0.9,
                             pad_id=0, max_batch=max_batch)  # fmt: skip
    return [g.completions for g in groups]


@pytest.mark.parametrize("rollouts", [_flat, _trees], ids=["flat", "tree"])
def test_a_prompts_completions_depend_on_its_key_not_its_batch(rollouts) -> None:  # noqa: ANN001
    """Two ranks' shares, or one rank's whole batch, in calls of other sizes: the same samples."""
    model = tiny_llama()
    together = rollouts(model, [0, 1, 2, 3], max_batch=16)
    assert rollouts(model, [0, 1], max_batch=4) + rollouts(model, [2, 3], max_batch=4) == together
    assert rollouts(model, [3], max_batch=16) == together[3:]
    assert len({str(c) for c in together[1]}) > 1  # sampled, not one greedy answer
    assert rollouts(model, [0, 1, 2, 3], max_batch=16, run="another seed") != together
