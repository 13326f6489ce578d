"""The rollouts' per-row sampling streams (grpo.sampling.RowSampler): draws from the tempered,
top-p distribution, and a prompt's completions that depend on its key only, not on the batch it
shares or the rank that draws it (what lets GRPO resume under another data-parallel size)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from harness.models import tiny_llama, tiny_moe
from transformers import LlamaForCausalLM

from stagetrain.errors import StageError
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


def _whole_rows(model: LlamaForCausalLM, items: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Each completion token's log-prob (temperature 1) from a forward of its whole row."""
    width = max(len(p) + len(c) for p, c in items)
    ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in items])
    mask = torch.tensor(
        [[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c in items]
    )
    logprobs = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
    return logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_completions_scored_over_their_shared_prompt_match_whole_rows(checkpointing: bool) -> None:
    """token_logprobs runs each distinct prompt once and the completions over its repeated cache
    (grpo.shared_prompts): the same log-probs and the same gradient as forwards of the whole
    rows, with prompts of different lengths, completions of different lengths and one group's
    rows apart. A model that checkpoints its activations drops a cache while it builds a
    graph, so there every row runs whole."""
    model = tiny_llama().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    items = [(PROMPTS[i % 3], [12 + i] * (1 + i % 4) + [1]) for i in range(9)]
    weights = torch.linspace(-1.0, 1.0, 9).unsqueeze(1)

    def gradient(logprobs: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        (logprobs * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    rows: list[int] = []
    positions: list[int] = []  # of the logits each forward returned
    hooks = [
        model.register_forward_pre_hook(
            lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        ),
        model.register_forward_hook(lambda _, args, out: positions.append(out.logits.shape[1])),
    ]
    scored = token_logprobs(model, items, torch.device("cpu"), 0, temperature=1.0, top_p=1.0)
    for hook in hooks:
        hook.remove()
    assert rows == ([9] if checkpointing else [3, 9])  # three prompts, then nine completions
    # The prompts' LM head runs at their last position alone, not over every prompt position.
    assert positions == ([10] if checkpointing else [1, 5])
    whole = _whole_rows(model, items) * scored.mask
    assert scored.mask.sum() == sum(len(c) for _, c in items)
    assert torch.allclose(scored.logprobs * scored.mask, whole, atol=1e-5)
    assert (whole != 0).sum() == scored.mask.sum()  # every token scored, none of them 0
    shared, full = gradient(scored.logprobs * scored.mask), gradient(whole)
    # Relative to each gradient's norm: the sums run in another order, and a CPU's kernels set
    # how far apart that leaves them (5.7e-6 seen on one Xeon, entries to 1e-4 at values of 13).
    assert all((a - b).norm() <= 1e-4 * b.norm() for a, b in zip(shared, full, strict=True))
    assert max(float(a.abs().max()) for a in shared) > 1e-3  # a gradient, not zeros


def test_a_forward_that_keeps_no_cache_stops_in_one_line() -> None:
    """A forward that takes the cache under another keyword swallows this one in its **kwargs
    (transformers 5.17's took `past_key_values`) and leaves it empty: the completions would be
    scored without their prompts, so the stage stops, naming the model and the keyword."""

    class Forgetful(torch.nn.Module):
        def __init__(self, model: LlamaForCausalLM) -> None:
            super().__init__()
            self.model = model

        def forward(self, cache: object = None, **kwargs: object) -> object:
            return self.model(**kwargs)

    items = [(PROMPTS[0], [12, 1]), (PROMPTS[0], [13, 1])]
    with pytest.raises(StageError) as err, torch.no_grad():
        token_logprobs(
            Forgetful(tiny_llama()), items, torch.device("cpu"), 0, temperature=1.0, top_p=1.0
        )
    assert str(err.value).startswith(
        "Forgetful kept no cache of the prompts' forward (passed as cache=)"
    )
