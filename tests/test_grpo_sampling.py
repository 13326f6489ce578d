"""The rollouts' per-row sampling streams (grpo.sampling.RowSampler): draws from the tempered,
top-p distribution, and a prompt's completions that depend on its key only, not on the batch it
shares or the rank that draws it (what lets GRPO resume under another data-parallel size)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from harness.models import tiny_llama, tiny_moe
from transformers import LlamaForCausalLM

from stagetrain.grpo.rollouts import flat_groups, tree_groups
from stagetrain.grpo.sampling import RowSampler, stream_seed
from stagetrain.grpo.steps import routing_flip_sums, token_logprobs
from stagetrain.grpo.tree import TreeConfig
from stagetrain.training.experts import routing_of

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
    sampler = RowSampler(0.7, 0.95, [stream_seed("t", i) for i in range(rows)], keep_scores=True)
    drawn = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, 4)).argmax(-1)
    freq = torch.bincount(drawn, minlength=4).double() / rows
    # top-p 0.95 of softmax(logits / 0.7) keeps the first three tokens (99.7% of the mass)
    # and drops the last; the kept ones renormalised.
    kept = torch.softmax(logits[:3].double() / 0.7, -1)
    se = (kept * (1 - kept) / rows).sqrt()
    assert freq[3] == 0
    assert ((freq[:3] - kept).abs() < 4 * se).all(), (freq, kept)
    assert torch.equal(sampler.warped[0][0, :3], logits[:3] / 0.7)  # what the entropy reads
    # The log-prob it records of each draw is the drawn token's under that distribution.
    assert torch.allclose(sampler.logprobs[0], kept.log()[drawn].float(), atol=1e-6)


@pytest.mark.parametrize("rollout", ["flat", "tree"])
def test_the_trainer_scores_the_tokens_as_the_sampler_drew_them(rollout: str) -> None:
    """The loss's log-probs (grpo.steps.token_logprobs, the stage's own) of the sampled tokens
    equal the sampler's at temperature 0.7 and top-p 0.9: the ratio and gradient are those of
    the policy that sampled. Scoring raw logits (temperature 1, no nucleus) is off by far more."""
    model = tiny_llama()
    score = lambda i, c: float(sum(c) % 2)  # noqa: E731
    common = {
        "keys": [("run", i) for i in range(len(PROMPTS))],
        "temperature": 0.7,
        "top_p": 0.9,
        "pad_id": 0,
    }
    with torch.no_grad():
        if rollout == "flat":
            groups = flat_groups(model, PROMPTS, score, group_size=4, max_new_tokens=8, eos_id=1,
                                 max_batch=16, **common)  # fmt: skip
        else:
            cfg = TreeConfig(branching=2, segment_tokens=3, max_leaves=6, max_tokens=60,
                             max_new_tokens=9, uct_c=1.0, eos_id=1)  # fmt: skip
            groups = tree_groups(model, PROMPTS, score, cfg, max_batch=6, **common)
        items = [(g.prompt, c) for g in groups for c in g.completions]
        drawn = [lp for g in groups for lp in g.sampler_logprobs]
        gaps = {}
        for name, policy in {"sampler's": (0.7, 0.9), "raw": (1.0, 1.0)}.items():
            logprobs, mask, *_ = token_logprobs(model, items, torch.device("cpu"), 0,
                                                temperature=policy[0], top_p=policy[1])  # fmt: skip
            trainer = [row[m.bool()].tolist() for row, m in zip(logprobs, mask, strict=True)]
            gaps[name] = max(abs(a - b) for t, d in zip(trainer, drawn, strict=True)
                             for a, b in zip(t, d, strict=True))  # fmt: skip
    assert sum(map(len, drawn)) > 40 and all(map(len, drawn))
    assert all(len(d) == len(c) for (_, c), d in zip(items, drawn, strict=True))
    assert gaps["sampler's"] < 1e-5, gaps
    assert gaps["raw"] > 0.05, gaps


@pytest.mark.parametrize(
    ("architecture", "rollout"),
    [("mixtral", "flat"), ("deepseek_v3", "flat"), ("mixtral", "tree"), ("deepseek_v3", "tree-uncached")],
)  # fmt: skip
def test_the_trainer_routes_the_sampled_tokens_as_the_sampler_did(
    architecture: str, rollout: str
) -> None:
    """In fp32 the KV-cached sampler and the full-sequence trainer choose the same experts for
    every sampled token's position in every MoE layer (DeepSeek's routing bias included), so
    the stage's routing-flip share is the kernels' and precision's, not a misaligned position:
    the same routings one position apart differ for most tokens. A tree's leaf joins the
    routing of its segments, each drawn in another round (from the prefix cache, or not)."""
    model = tiny_moe(architecture)
    routing = routing_of(model.config)
    common = {"keys": [("run", i) for i in range(len(PROMPTS))], "temperature": 0.7, "top_p": 0.9,
              "pad_id": 0, "routing": routing}  # fmt: skip
    with torch.no_grad():
        if rollout == "flat":
            groups = flat_groups(model, PROMPTS, lambda i, c: 0.0, group_size=4, max_new_tokens=8, eos_id=1,
                                 max_batch=8, **common)  # fmt: skip
        else:
            cfg = TreeConfig(branching=2, segment_tokens=3, max_leaves=4, max_tokens=60, max_new_tokens=9,
                             uct_c=1.0, eos_id=1, prefix_cache=rollout == "tree")  # fmt: skip
            groups = tree_groups(model, PROMPTS, lambda i, c: 0.0, cfg, max_batch=6, **common)
            assert max(len(c) for g in groups for c in g.completions) > cfg.segment_tokens
        items = [(g.prompt, c) for g in groups for c in g.completions]
        routed = [r for g in groups for r in g.sampler_routing]
        scored = token_logprobs(model, items, torch.device("cpu"), 0, temperature=0.7, top_p=0.9,
                                routing=routing)  # fmt: skip
    tokens = sum(len(c) for _, c in items)
    assert tokens > 40 and [r.shape for r in routed] == [(len(c), 2, 2) for _, c in items]
    # A tree puts in an eos where a continuation sampled pad first (the tiny Mixtral's tree does):
    # not drawn, so its routing is -1 and outside the pairs compared.
    drew = sum(int((r >= 0).all(-1).sum()) for r in routed)
    assert drew > 0.8 * tokens * 2
    assert (drew < tokens * 2) == ((architecture, rollout) == ("mixtral", "tree"))
    assert routing_flip_sums(scored.experts, routed, items) == (0, drew)
    late = torch.roll(scored.experts, 1, dims=1)
    assert routing_flip_sums(late, routed, items)[0] > 0.3 * drew
    assert (scored.aux_loss is None) == (architecture == "deepseek_v3")


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
