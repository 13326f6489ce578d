"""Invariants of the pure maths, held over every input hypothesis draws, not over chosen examples.

An example checks the numbers its author thought of: rewards of 0 and 1, edges that fall
between the difficulties, the newest tag intact. The guarantees these modules make are
statements about all inputs (advantages sum to zero in every group, a shift of a group's
rewards changes no loss, a value on an edge is in the level that edge starts, the newest
intact tag is the one resumed from), and a break of them often shows only on inputs nobody
wrote down: two groups at once, an empty sequence beside full ones, an integer difficulty
exactly on an edge, a damaged tag between intact ones. So each test here states one
guarantee and lets hypothesis search for a counterexample, through the stage's own
functions. They are in the fast tier: few examples each and no process beyond pytest's.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import get_args

import pytest
import torch
from harness.checkpoints import fake_checkpoint, saved, truncate
from harness.planning import cpu_hardware
from harness.workflow import default_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagetrain.config.settings import CurriculumSettings
from stagetrain.errors import StageError
from stagetrain.grpo.advantages import group_advantages, node_advantages, sibling_advantages
from stagetrain.grpo.curriculum import Curriculum, CurriculumState, top_level, update_all
from stagetrain.grpo.loss import LossType, grpo_loss
from stagetrain.grpo.tree import TreeSegment
from stagetrain.planning.plan import Layout
from stagetrain.planning.resolve import PlannerSettings, demands, devices_from
from stagetrain.planning.search import Demand, Devices, Knobs, _evaluate
from stagetrain.planning.shape import ModelShape
from stagetrain.tasks.families import _level
from stagetrain.training.checkpoints import Checkpoints, tag_of
from stagetrain.training.integrity import POINTER, expected_files, read_pointer

FAST = settings(max_examples=60, deadline=None)
"""deadline=None: torch's first calls and a loaded machine make single examples slow, never wrong."""
FILES = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
"""For the checkpoint folders: each example makes its own folder under tmp_path, so sharing
the function-scoped fixture across examples is safe."""
LOSS_TYPES = st.sampled_from(get_args(LossType))
REWARDS = st.floats(-100, 100, allow_nan=False, allow_subnormal=False)


# --- advantages --------------------------------------------------------------------------------


@st.composite
def reward_groups(draw: st.DrawFn, size: int | None = None) -> list[list[float]]:
    """Rewards shaped (groups, G), G >= 2 (`size` if given); some groups all equal, as a task
    often gives."""
    size = size or draw(st.integers(2, 8))
    group = st.one_of(
        st.lists(REWARDS, min_size=size, max_size=size),
        REWARDS.map(lambda r: [r] * size),
    )
    return draw(st.lists(group, min_size=1, max_size=4))


@st.composite
def trees(draw: st.DrawFn) -> list[TreeSegment]:
    """A completion tree as the search leaves it: leaves scored, each node the mean of its leaves."""
    n = draw(st.integers(1, 10))
    parents = [None] + [draw(st.none() | st.integers(0, i - 1)) for i in range(1, n)]
    children: dict[int | None, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    leaves = [i for i in range(n) if i not in children]
    reward = {i: draw(REWARDS | st.sampled_from([0.0, 1.0])) for i in leaves}

    def under(i: int) -> list[float]:
        return [reward[i]] if i in reward else [r for c in children[i] for r in under(c)]

    return [
        TreeSegment(node_id=i, parent_id=p, value=sum(under(i)) / len(under(i)), visits=1,
                    start=0, length=draw(st.integers(1, 4)))
        for i, p in enumerate(parents)
    ]  # fmt: skip


def rounding(rewards: torch.Tensor) -> float:
    """How far from zero rounding alone may leave the advantage sum of a group of G rewards:
    a few ulps of the largest in each one's distance to the mean, over the std + eps."""
    r = rewards.double()
    if len(r) < 2:
        return 0.0
    ulp = torch.finfo(rewards.dtype).eps * (1 + r.abs().max().item())
    return 8 * len(r) * ulp / (r.std().item() + 1e-4)


@FAST
@given(rewards=reward_groups(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_group_advantages_sum_to_zero_in_every_group(
    rewards: list[list[float]], dtype: torch.dtype
) -> None:
    """The mean is the baseline of each group on its own: what one completion gains, the
    others of its prompt lose, whatever the other groups of the batch hold."""
    stored = torch.tensor(rewards, dtype=dtype)
    adv, _ = group_advantages(stored)
    for row, group in zip(adv, stored, strict=True):
        assert abs(row.double().sum().item()) <= rounding(group)


@FAST
@given(segments=trees())
def test_tree_advantages_sum_to_zero_over_each_set_of_siblings_and_over_the_leaves(
    segments: list[TreeSegment],
) -> None:
    """The tree mode's two normalisations (sib over a node's children, leaf over the prompt's
    leaves) are each a group of their own: each sums to zero."""
    sib = node_advantages(segments)
    parents = {s.parent_id for s in segments}
    for parent in parents:
        group = [s for s in segments if s.parent_id == parent]
        values = torch.tensor([s.value for s in group], dtype=torch.float64)
        assert abs(sum(sib[s.node_id] for s in group)) <= rounding(values)
    leaves = [s.value for s in segments if s.node_id not in parents]
    assert abs(sum(sibling_advantages(leaves))) <= rounding(
        torch.tensor(leaves, dtype=torch.float64)
    )


@st.composite
def with_an_equal_group(draw: st.DrawFn) -> list[list[float]]:
    """Groups of one size whose first holds one reward repeated, of any magnitude and sign."""
    size = draw(st.integers(2, 8))
    value = draw(st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False))
    return [[value] * size, *(draw(st.none() | reward_groups(size)) or [])]


@FAST
@given(rows=with_an_equal_group(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_a_group_of_equal_rewards_has_exactly_zero_advantages_and_is_flagged(
    rows: list[list[float]], dtype: torch.dtype
) -> None:
    """A group with nothing to compare teaches nothing: its advantages are exactly 0 (not the
    rounding error of r - mean(r) over eps) and it is flagged, so the stage drops it and logs
    the share; a group with any two rewards apart is not flagged."""
    rewards = torch.tensor(rows, dtype=dtype)
    adv, zero_std = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros_like(adv[0])) and bool(zero_std[0])
    assert zero_std.tolist() == [bool((r == r[0]).all()) for r in rewards]
    assert sibling_advantages(rows[0]) == [0.0] * len(rows[0])


# --- the loss ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One GRPO batch of `groups` prompts x `size` completions over T token positions (float64,
    so that an invariant is held to rounding, not to float32's)."""

    rewards: torch.Tensor
    """(groups, size)."""
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    mask: torch.Tensor
    token_weights: torch.Tensor | None
    token_advantages: torch.Tensor | None
    """(B, T) advantages, the tree mode's; None: each sequence's group advantage (flat mode)."""
    eps_low: float
    eps_high: float

    def advantages(self, rewards: torch.Tensor | None = None) -> torch.Tensor:
        """Per sequence (flat_groups: the group advantage of its rewards) or per token."""
        if self.token_advantages is not None:
            return self.token_advantages
        return group_advantages(self.rewards if rewards is None else rewards)[0].reshape(-1)

    def loss(self, advantages: torch.Tensor, *, loss_type: LossType, beta: float,
             rows: slice | None = None, max_length: int | None = None) -> float:  # fmt: skip
        """grpo_loss of `rows` of the batch (all by default) with these advantages."""
        at = slice(None) if rows is None else rows
        loss, _ = grpo_loss(
            self.logprobs[at], self.old_logprobs[at], self.ref_logprobs[at], advantages[at],
            self.mask[at], eps_low=self.eps_low, eps_high=self.eps_high, beta=beta,
            loss_type=loss_type, max_length=max_length,
            token_weights=None if self.token_weights is None else self.token_weights[at],
        )  # fmt: skip
        return loss.item()


@st.composite
def batches(draw: st.DrawFn, per_token: bool | None = None) -> Batch:
    """A batch with ratios inside and outside the clip range, empty and partly masked
    sequences, with or without token weights, advantages per sequence or (`per_token`) per
    token; None: either."""
    groups, size, t = draw(st.integers(1, 3)), draw(st.integers(2, 3)), draw(st.integers(1, 4))
    b = groups * size

    def grid(low: float, high: float) -> torch.Tensor:
        cells = st.lists(st.floats(low, high), min_size=t, max_size=t)
        return torch.tensor(draw(st.lists(cells, min_size=b, max_size=b)), dtype=torch.float64)

    logprobs = grid(-4, 0)
    rows = st.lists(
        st.lists(REWARDS, min_size=size, max_size=size), min_size=groups, max_size=groups
    )
    bits = st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)
    return Batch(
        rewards=torch.tensor(draw(rows), dtype=torch.float64),
        logprobs=logprobs,
        old_logprobs=logprobs + grid(-0.6, 0.6),
        ref_logprobs=logprobs + grid(-1, 1),
        mask=torch.tensor(draw(bits), dtype=torch.float64),
        token_weights=grid(0, 2) if draw(st.booleans()) else None,
        token_advantages=grid(-3, 3)
        if draw(st.booleans() if per_token is None else st.just(per_token))
        else None,
        eps_low=draw(st.floats(0, 0.5)),
        eps_high=draw(st.floats(0, 0.5)),
    )


BETAS = st.sampled_from([0.0, 0.04]) | st.floats(0, 2)


@FAST
@given(batch=batches(per_token=False), shifts=st.lists(REWARDS, min_size=3, max_size=3),
       loss_type=LOSS_TYPES, beta=BETAS)  # fmt: skip
def test_every_loss_is_unchanged_when_a_groups_rewards_shift_by_a_constant(
    batch: Batch, shifts: list[float], loss_type: LossType, beta: float
) -> None:
    """Only how a completion compares with the others of its prompt is learnt from: a task
    that pays every completion of a prompt 5 more (a bonus, an offset in a reward function)
    trains exactly as before, each group shifted by its own constant."""
    shifted = (
        batch.rewards + torch.tensor(shifts[: len(batch.rewards)], dtype=torch.float64)[:, None]
    )
    before = batch.loss(batch.advantages(), loss_type=loss_type, beta=beta)
    after = batch.loss(batch.advantages(shifted), loss_type=loss_type, beta=beta)
    assert after == pytest.approx(before, rel=1e-9, abs=1e-9)


@FAST
@given(batch=batches(), scale=st.floats(1e-3, 1e3), loss_type=LOSS_TYPES, beta=BETAS)
def test_every_loss_is_its_policy_term_times_the_advantage_scale_plus_beta_times_its_kl(
    batch: Batch, scale: float, loss_type: LossType, beta: float
) -> None:
    """loss_t = w * pg + beta * k3, pg = -min(ratio A, clip(ratio) A): rewards k times larger
    (k > 0) give a policy-gradient term k times larger and leave the KL term alone, which
    beta scales; the token weights multiply the first and not the second."""
    adv = batch.advantages()
    pg = batch.loss(adv, loss_type=loss_type, beta=0.0)
    kl = batch.loss(torch.zeros_like(adv), loss_type=loss_type, beta=1.0)
    both = batch.loss(scale * adv, loss_type=loss_type, beta=beta)
    assert both == pytest.approx(scale * pg + beta * kl, rel=1e-9, abs=1e-9)


@FAST
@given(batch=batches(), loss_type=LOSS_TYPES, beta=BETAS, budget=st.integers(0, 4),
       garbage=st.sampled_from([math.inf, -math.inf, 1e30]))  # fmt: skip
def test_each_loss_weighs_tokens_as_its_docstring_says_and_ignores_masked_padding(
    batch: Batch, loss_type: LossType, beta: float, budget: int, garbage: float
) -> None:
    """The three aggregations, in terms of each sequence's own loss: "grpo" is the mean over
    the sequences that have tokens (an empty one is as if dropped), "dapo" weighs each
    sequence by its tokens (every token the same), "dr_grpo" is the sum over B x max_length
    (every sequence the same, empty ones included). Padding past T, masked, whatever it
    holds, changes none of them (max_length, the generation budget, fixes dr_grpo's)."""
    adv = batch.advantages()
    b, t = batch.logprobs.shape
    max_length = t + budget
    whole = batch.loss(adv, loss_type=loss_type, beta=beta, max_length=max_length)
    own = [batch.loss(adv, loss_type=loss_type, beta=beta, rows=slice(i, i + 1),
                      max_length=max_length) for i in range(b)]  # fmt: skip
    tokens = batch.mask.sum(dim=1).tolist()
    if loss_type == "grpo":
        expected = sum(own) / max(1, sum(n > 0 for n in tokens))
    elif loss_type == "dapo":
        expected = sum(x * n for x, n in zip(own, tokens, strict=True)) / max(1.0, sum(tokens))
    else:
        expected = sum(own) / b
    assert whole == pytest.approx(expected, rel=1e-9, abs=1e-12)

    def pad(x: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        return (
            None if x is None else torch.cat([x, torch.full((b, budget), fill, dtype=x.dtype)], 1)
        )

    padded = replace(
        batch, logprobs=pad(batch.logprobs, garbage), old_logprobs=pad(batch.old_logprobs, -garbage),
        ref_logprobs=pad(batch.ref_logprobs, garbage), mask=pad(batch.mask, 0.0),
        token_weights=pad(batch.token_weights, garbage), token_advantages=pad(batch.token_advantages, garbage),
    )  # fmt: skip
    assert padded.loss(padded.advantages(), loss_type=loss_type, beta=beta,
                       max_length=max_length) == pytest.approx(whole, rel=1e-12, abs=1e-15)  # fmt: skip


# --- the curriculum ----------------------------------------------------------------------------


@st.composite
def curricula(draw: st.DrawFn) -> tuple[CurriculumSettings, CurriculumState, CurriculumState]:
    """A valid grpo.curriculum and two states of one family under it, anywhere in its life:
    the same level and steps, the second's window as successful as the first's or more."""
    promote_at = draw(st.floats(0, 1, exclude_min=True))
    cfg = CurriculumSettings(
        families=(),
        start_level=1,
        max_level=draw(st.integers(1, 6)),
        window=draw(st.integers(1, 6)),
        promote_at=promote_at,
        demote_below=draw(st.floats(0, promote_at, exclude_max=True)),
        min_steps=draw(st.integers(1, 3)),
        earlier_share=0.0,
    )
    family = draw(st.sampled_from(["arithmetic", "comparison", "counting"]))
    recent = draw(st.lists(st.integers(0, 1), max_size=cfg.window))
    better = draw(st.lists(st.integers(0, 1), min_size=len(recent), max_size=len(recent)))
    weak = CurriculumState(
        family=family,
        level=draw(st.integers(1, top_level(cfg, family))),
        steps_at_level=draw(st.integers(0, 4)),
        recent=recent,
    )
    strong = replace(weak, recent=[max(r, b) for r, b in zip(recent, better, strict=True)])
    return cfg, weak, strong


OUTCOMES = st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(-1, 3)
MORE = st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 2)


@FAST
@given(setup=curricula(), pairs=st.lists(st.tuples(OUTCOMES, MORE), max_size=8))
def test_more_success_never_gives_a_lower_level_or_less_promotion(
    setup: tuple[CurriculumSettings, CurriculumState, CurriculumState],
    pairs: list[tuple[float, float]],
) -> None:
    """From the same point, a step whose rewards are each at least as high (a reward >= 1
    is a success), after a window at least as successful, never ends at a lower level: where
    the weaker family is promoted, the stronger one is too; where the stronger one is
    demoted, the weaker one is too."""
    cfg, weak, strong = setup
    outcomes = {
        "weak": [(weak.family, weak.level, r) for r, _ in pairs],
        "strong": [(strong.family, strong.level, r + more) for r, more in pairs],
    }
    moved = {}
    for name, state in (("weak", weak), ("strong", strong)):
        events = update_all(Curriculum(states={state.family: state}), cfg, 1, outcomes[name])
        moved[name] = events[0]["kind"] if events else None
    assert strong.level >= weak.level
    assert moved["weak"] != "promote" or moved["strong"] == "promote"
    assert moved["strong"] != "demote" or moved["weak"] == "demote"


# --- difficulty buckets (tasks.families.*.level_edges) ------------------------------------------

DIFFICULTIES = st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6, allow_nan=False)


@FAST
@given(edges=st.lists(DIFFICULTIES, min_size=1, max_size=6),
       values=st.lists(DIFFICULTIES, min_size=1, max_size=12))  # fmt: skip
def test_every_difficulty_gets_a_level_and_a_larger_one_never_a_lower_level(
    edges: list[float], values: list[float]
) -> None:
    """Whatever the edges (in any order, repeated), every finite difficulty lands in one of
    levels 1 .. len(edges) + 1, and sorting the difficulties sorts their levels."""
    levels = [_level(v, edges, "t.jsonl:1", "difficulty") for v in sorted(values)]
    assert all(1 <= lv <= len(edges) + 1 for lv in levels)
    assert levels == sorted(levels)


@FAST
@given(edges=st.sets(st.integers(-1000, 1000), min_size=1, max_size=6),
       as_floats=st.booleans())  # fmt: skip
def test_an_integer_difficulty_on_an_edge_is_in_the_level_that_edge_starts(
    edges: set[int], as_floats: bool
) -> None:
    """The common case: integer difficulties, integer edges. Level = 1 + the edges <= it
    (docs: [3, 4] makes 2 -> 1, 3 -> 2, 4 -> 3): a difficulty equal to the k-th edge is in
    level k + 1, the one below it in level k; an edge written 3.0 cuts where 3 does."""
    ordered = sorted(edges)
    given_edges = [float(e) for e in ordered] if as_floats else ordered
    for k, edge in enumerate(ordered, start=1):
        assert _level(edge, given_edges, "t.jsonl:1", "difficulty") == k + 1
        assert _level(edge - 1, given_edges, "t.jsonl:1", "difficulty") == k
    assert _level(ordered[0] - 10**6, given_edges, "t.jsonl:1", "difficulty") == 1
    assert _level(ordered[-1] + 10**6, given_edges, "t.jsonl:1", "difficulty") == len(edges) + 1


@FAST
@given(edges=st.sets(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=6))
def test_a_fractional_difficulty_on_an_edge_is_in_the_level_that_edge_starts(
    edges: set[float],
) -> None:
    """The same at float edges: the edge itself is in the upper level, the next float below
    it in the lower one, so no difficulty falls between two levels."""
    ordered = sorted(edges)
    for k, edge in enumerate(ordered, start=1):
        assert _level(edge, ordered, "t.jsonl:1", "difficulty") == k + 1
        assert _level(math.nextafter(edge, -math.inf), ordered, "t.jsonl:1", "difficulty") == k


# --- the planner's memory estimate -------------------------------------------------------------


@cache
def planner() -> tuple[PlannerSettings, Devices, Knobs]:
    """The default config's planner sections, a described 2-rank CPU machine, and the knobs."""
    config = PlannerSettings.from_config(default_config())
    devices = devices_from(cpu_hardware(), config.hardware)
    return config, devices, Knobs(parallelism=config.parallelism, deepspeed=config.deepspeed)


@st.composite
def shapes(draw: st.DrawFn) -> ModelShape:
    """A model's shape, dense or with routed experts: the estimate must hold for any size."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if heads % d == 0]))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    hidden, layers = heads * head_dim, draw(st.integers(1, 32))
    inter = draw(st.integers(1, 4 * hidden))
    vocab = draw(st.sampled_from([512, 32768, 128256]))
    experts = draw(st.sampled_from([0, 0, 4, 8]))
    per_token = draw(st.integers(1, experts)) if experts else 0
    embedding = vocab * hidden * draw(st.sampled_from([1, 2]))
    expert_params = layers * experts * 3 * hidden * inter
    layer = 4 * hidden * hidden + (3 * hidden * inter if not experts else expert_params // layers)
    params = layers * layer + embedding + hidden
    return ModelShape(
        params=params, active_params=params - (expert_params * (experts - per_token) // max(1, experts)),
        layer_params=layer, embedding_params=embedding, largest_module_params=max(vocab * hidden, 4 * hidden * inter),
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter * max(1, per_token), experts_per_token=per_token, num_experts=experts,
        expert_params=expert_params, moe_layers=layers if experts else 0,
        model_type="mixtral" if experts else "llama", vocab_size=vocab, kv_cache_width=2 * kv_heads * head_dim,
    )  # fmt: skip


@st.composite
def layouts(draw: st.DrawFn, shape: ModelShape) -> tuple[Layout, int]:
    """A layout the search could price for `shape`, and its rows per rank (mbs x ga)."""
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if shape.num_kv_heads % t == 0]))
    dp = draw(st.integers(1, 8))
    zero = draw(st.integers(0, 2 if tp > 1 else 3))
    offload = draw(st.sampled_from(["none", *(["optimizer"] if zero >= 2 else []),
                                    *(["optimizer_and_params"] if zero == 3 else [])]))  # fmt: skip
    ep = 1
    if shape.num_experts and tp == 1 and zero >= 1:
        ep = draw(
            st.sampled_from([e for e in (1, 2, 4) if dp % e == 0 and shape.num_experts % e == 0])
        )
    rows = draw(st.integers(1, 64))
    layout = Layout(
        world=dp * tp, gpus_per_node=dp * tp, dp=dp, tp=tp, ep=ep, micro_batch_size=1,
        grad_accum=rows, global_batch=rows * dp, seq_len=draw(st.integers(1, 8192)), zero_stage=zero,
        activation_checkpointing=draw(st.booleans()), offload=offload,
        precision=draw(st.sampled_from(["bf16", "fp16", "fp32"])), num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, num_experts=shape.num_experts,
    )  # fmt: skip
    return layout, rows


def stage_demand(which: str, kl_coef: float, prompts: int, group: int) -> Demand:
    """The pretrain stage's demand, or GRPO's (its reference, gathered policy and KV cache),
    as `demands` makes them; "grpo-per-token" is the search's fallback that gathers per token."""
    config, devices, _ = planner()
    grpo = replace(config.grpo, kl_coef=kl_coef, prompts_per_step=prompts, group_size=group)
    pretrain, flat = demands(config.pretrain, grpo, devices)
    if which == "pretrain":
        return pretrain
    if which == "grpo":
        return flat
    assert flat.per_token_extra_bytes is not None
    return replace(flat, extra_bytes=flat.per_token_extra_bytes)


@FAST
@given(data=st.data(), shape=shapes(), which=st.sampled_from(["pretrain", "grpo", "grpo-per-token"]),
       kl_coef=st.sampled_from([0.0, 0.1]), prompts=st.integers(1, 32), group=st.integers(2, 8))  # fmt: skip
def test_the_memory_estimate_never_falls_as_the_micro_batch_or_the_sequence_grows(
    data: st.DataObject, shape: ModelShape, which: str, kl_coef: float, prompts: int, group: int
) -> None:
    """The search prices each candidate with this estimate and keeps those that fit: were a
    larger micro batch (same global batch, fewer accumulation steps) or a longer sequence
    ever cheaper, it would pick a layout that runs out of memory, or reject one that fits."""
    layout, rows = data.draw(layouts(shape))
    demand = stage_demand(which, kl_coef, prompts, group)
    _, devices, knobs = planner()

    def total(changed: Layout) -> int:
        return _evaluate(changed, shape, devices, demand, knobs, None).memory.total

    batches = [m for m in range(1, rows + 1) if rows % m == 0]
    small, large = sorted(data.draw(st.lists(st.sampled_from(batches), min_size=2, max_size=2)))
    at = {m: replace(layout, micro_batch_size=m, grad_accum=rows // m) for m in (small, large)}
    assert total(at[small]) <= total(at[large])
    short, long = sorted(data.draw(st.lists(st.integers(1, 8192), min_size=2, max_size=2)))
    assert total(replace(layout, seq_len=short)) <= total(replace(layout, seq_len=long))


# --- resuming: the newest intact checkpoint ----------------------------------------------------

LAYOUTS = [
    {"dp": 2, "tp": 1, "zero_stage": 2}, {"dp": 1, "tp": 1, "zero_stage": 0},
    {"dp": 2, "tp": 2, "zero_stage": 1}, {"dp": 2, "tp": 1, "zero_stage": 3},
    {"dp": 4, "tp": 1, "zero_stage": 2}, {"dp": 1, "tp": 1, "zero_stage": 2},
]  # fmt: skip
CHECKPOINT_LAYOUTS = st.sampled_from(LAYOUTS)
DAMAGE = st.sampled_from(["cut", "deleted", "empty", "gone"])
STEPS = st.sets(st.integers(0, 10**8 - 1), min_size=1, max_size=5)


def damage(folder: Path, step: int, how: str) -> None:
    """Leave tag `step` as a kill, a full disk or a hand leaves it: a file cut short, a file
    deleted, a file that is no checkpoint, or the whole folder gone."""
    base = folder / tag_of(step)
    files = sorted(base.iterdir())
    if how == "cut":
        truncate(files[0])
    elif how == "deleted":
        files[-1].unlink()
    elif how == "empty":
        torch.save({}, files[0])
    else:
        for path in files:
            path.unlink()
        base.rmdir()


def names(layout: dict[str, int]) -> set[str]:
    """The file names of a tag written under `layout`."""
    return {p.name for p in expected_files(Path("tag"), layout)}


@FILES
@given(layout=CHECKPOINT_LAYOUTS, steps=STEPS, data=st.data())
def test_a_lost_pointer_is_rebuilt_at_the_newest_intact_tag_of_this_layout(
    tmp_path: Path, layout: dict[str, int], steps: set[int], data: st.DataObject
) -> None:
    """Without latest.json, the run resumes from the newest tag whose files are all there and
    load under its layout, whichever of the others are damaged or were written under another
    layout (one that writes other files: a larger dp, another tp, ZeRO-0 against ZeRO 1-2),
    and the rebuilt pointer lists exactly the intact ones, newest first; with none intact it
    starts fresh and writes no pointer. (Another layout's tag is left whole here: one that
    lost the files telling its layout apart is, by its names, this layout's.)"""
    ckpt = Checkpoints(Path(tempfile.mkdtemp(dir=tmp_path)), {"seed": 1}, layout, keep=3)
    others = [o for o in LAYOUTS if names(o) != names(layout)]
    written = {
        s: data.draw(st.sampled_from(others)) if data.draw(st.booleans()) else layout for s in steps
    }
    damaged = {
        s: data.draw(DAMAGE) for s in steps if written[s] == layout and data.draw(st.booleans())
    }
    for step in sorted(steps):
        fake_checkpoint(ckpt.folder, step, written[step])
        if step in damaged:
            damage(ckpt.folder, step, damaged[step])
    intact = sorted((s for s in steps if s not in damaged and written[s] == layout), reverse=True)
    point = ckpt.latest()
    if not intact:
        assert point is None and not (ckpt.folder / POINTER).exists()
        return
    tags = [tag_of(s) for s in intact]
    assert point is not None and (point["tag"], point["step"]) == (tags[0], intact[0])
    assert point["complete"] == tags and point["layout"] == layout
    assert read_pointer(ckpt.folder / POINTER)["complete"] == tags


@FILES
@given(layout=CHECKPOINT_LAYOUTS, steps=STEPS, data=st.data())
def test_a_damaged_newest_tag_falls_back_to_the_newest_intact_one_the_pointer_lists(
    tmp_path: Path, layout: dict[str, int], steps: set[int], data: st.DataObject
) -> None:
    """With latest.json, whichever of its listed tags are damaged, the run resumes from the
    newest intact one; with every one damaged it stops with one line rather than starting over."""
    ckpt = saved(Path(tempfile.mkdtemp(dir=tmp_path)), sorted(steps), layout, keep=len(steps))
    damaged = {s: data.draw(DAMAGE) for s in steps if data.draw(st.booleans())}
    for step, how in damaged.items():
        damage(ckpt.folder, step, how)
    intact = sorted(steps - set(damaged), reverse=True)
    if not intact:
        with pytest.raises(StageError, match="delete .* to start fresh$"):
            ckpt.latest()
        return
    point = ckpt.latest()
    assert point is not None and (point["tag"], point["step"]) == (tag_of(intact[0]), intact[0])
