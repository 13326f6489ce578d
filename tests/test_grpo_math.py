"""Pure maths of the GRPO stage: advantages (group and tree), the clipped loss, the curriculum."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from harness.workflow import REPO
from transformers import LlamaConfig, LlamaForCausalLM

from stagetrain.config.settings import CurriculumSettings
from stagetrain.errors import StageError
from stagetrain.grpo.advantages import (
    group_advantages,
    leaf_paths,
    node_advantages,
    sibling_advantages,
    tree_token_advantages,
)
from stagetrain.grpo.curriculum import (
    Curriculum,
    CurriculumState,
    draw,
    levels_for,
    top_level,
    update,
    update_all,
    window_rate,
)
from stagetrain.grpo.loss import LossStats, grpo_loss
from stagetrain.tasks.registry import FAMILIES, Family

# A tree row as grpo.advantages reads it (the search's TreeSegment carries more fields).
Segment = namedtuple("Segment", "node_id parent_id value length")

# --- group advantages ---------------------------------------------------------------------------


def test_group_advantages_use_the_sample_std_per_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    adv, zero = group_advantages(rewards, eps=0.0)
    for g in range(2):
        row = rewards[g].tolist()
        mean, std = statistics.fmean(row), statistics.stdev(row)  # stdev: divisor n - 1
        assert adv[g].tolist() == pytest.approx([(r - mean) / std for r in row])
    assert zero.tolist() == [False, False]
    assert adv.sum(dim=1).abs().max() < 1e-6


def test_groups_with_equal_rewards_get_zero_advantages_and_are_flagged() -> None:
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 1.0], [0, 0, 0]], dtype=torch.float32)
    adv, zero = group_advantages(rewards)
    assert zero.tolist() == [True, False, True]
    assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(adv[2], torch.zeros(3))
    assert zero.float().mean().item() == pytest.approx(2 / 3)  # frac_reward_zero_std


def test_group_advantages_take_integer_rewards_and_refuse_groups_of_one() -> None:
    adv, _ = group_advantages(torch.tensor([[1, 0]]), eps=0.0)
    assert adv[0].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])
    with pytest.raises(StageError, match=r"^grpo\.group_size: "):
        group_advantages(torch.ones(3, 1))


def test_rewards_not_shaped_groups_by_group_size_are_refused_naming_their_shape() -> None:
    with pytest.raises(
        ValueError, match=r"^rewards must be shaped \(groups, group_size\), got \(2, 2, 2\)$"
    ):
        group_advantages(torch.zeros(2, 2, 2))


def test_sibling_advantages() -> None:
    assert sibling_advantages([]) == []
    assert sibling_advantages([0.7]) == [0.0]
    assert sibling_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    s = statistics.stdev([0.0, 0.5, 1.0])  # 0.5
    assert sibling_advantages([0.0, 0.5, 1.0], eps=1e-4) == pytest.approx(
        [-0.5 / (s + 1e-4), 0.0, 0.5 / (s + 1e-4)]
    )
    # eps defaults to 1e-4, here as in group_advantages.
    assert sibling_advantages([0.0, 1.0]) == pytest.approx(
        [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)]
    )


def test_sibling_advantages_are_computed_in_double_precision() -> None:
    values = [1 / 3, 2 / 3, 0.1]
    mean, std = statistics.fmean(values), statistics.stdev(values)
    expected = [(v - mean) / (std + 1e-4) for v in values]
    assert sibling_advantages(values) == pytest.approx(expected, rel=1e-12, abs=1e-12)


# --- tree advantages ----------------------------------------------------------------------------


def _example_tree() -> list[Segment]:
    """The module docstring's tree: root -> A (-> A1, A2), B."""
    return [
        Segment(node_id="A", parent_id=None, value=0.5, length=3),
        Segment(node_id="B", parent_id=None, value=1.0, length=4),
        Segment(node_id="A1", parent_id="A", value=1.0, length=2),
        Segment(node_id="A2", parent_id="A", value=0.0, length=1),
    ]


def test_tree_token_advantages_match_the_hand_computed_example() -> None:
    eps = 1e-4
    # Siblings {A: 0.5, B: 1}: mean 0.75, sample std sqrt(2 * 0.25^2 / 1).
    sib_a = -0.25 / (math.sqrt(0.125) + eps)
    # Siblings {A1: 1, A2: 0}: mean 0.5, sample std sqrt(2 * 0.5^2 / 1).
    sib_a1 = 0.5 / (math.sqrt(0.5) + eps)
    # Leaves {A1: 1, A2: 0, B: 1}: mean 2/3, sample std sqrt((1/9 + 4/9 + 1/9) / 2).
    leaf_std = math.sqrt(1 / 3) + eps
    leaf_a1, leaf_a2, leaf_b = (1 / 3) / leaf_std, (-2 / 3) / leaf_std, (1 / 3) / leaf_std

    adv = tree_token_advantages(_example_tree(), eps=eps)
    assert set(adv) == {"A1", "A2", "B"}
    assert adv["A1"].tolist() == pytest.approx([sib_a + leaf_a1] * 3 + [sib_a1 + leaf_a1] * 2)
    assert adv["A2"].tolist() == pytest.approx([sib_a + leaf_a2] * 3 + [-sib_a1 + leaf_a2])
    assert adv["B"].tolist() == pytest.approx([-sib_a + leaf_b] * 4)
    # The rounded numbers the docstring shows.
    assert adv["A1"][0].item() == pytest.approx(-0.1298, abs=1e-3)
    assert adv["A2"][0].item() == pytest.approx(-1.8618, abs=1e-3)
    assert adv["B"][0].item() == pytest.approx(1.2845, abs=1e-3)


def test_eps_is_used_at_both_levels_of_the_tree() -> None:
    eps = 1.0  # large enough to show at every term
    sib_a, sib_a1 = -0.25 / (math.sqrt(0.125) + eps), 0.5 / (math.sqrt(0.5) + eps)
    leaf_std = math.sqrt(1 / 3) + eps
    leaf_a1, leaf_a2, leaf_b = (1 / 3) / leaf_std, (-2 / 3) / leaf_std, (1 / 3) / leaf_std
    adv = tree_token_advantages(_example_tree(), eps=eps)
    assert adv["A1"].tolist() == pytest.approx([sib_a + leaf_a1] * 3 + [sib_a1 + leaf_a1] * 2)
    assert adv["A2"].tolist() == pytest.approx([sib_a + leaf_a2] * 3 + [-sib_a1 + leaf_a2])
    assert adv["B"].tolist() == pytest.approx([-sib_a + leaf_b] * 4)
    assert node_advantages(_example_tree(), eps=eps) == pytest.approx(
        {"A": sib_a, "B": -sib_a, "A1": sib_a1, "A2": -sib_a1}
    )
    # eps defaults to 1e-4.
    sib_a, sib_a1 = -0.25 / (math.sqrt(0.125) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)
    assert node_advantages(_example_tree()) == pytest.approx(
        {"A": sib_a, "B": -sib_a, "A1": sib_a1, "A2": -sib_a1}
    )


def test_leaf_paths_run_root_to_leaf_and_lengths_line_up() -> None:
    tree = _example_tree()
    paths = leaf_paths(tree)
    assert {k: [s.node_id for s in v] for k, v in paths.items()} == {
        "A1": ["A", "A1"],
        "A2": ["A", "A2"],
        "B": ["B"],
    }
    adv = tree_token_advantages(tree)
    assert all(len(adv[k]) == sum(s.length for s in p) for k, p in paths.items())
    assert all(a.dtype == torch.float32 for a in adv.values())


def test_a_chain_and_equal_leaves_give_zero_advantages() -> None:
    chain = [
        Segment(node_id=0, parent_id=None, value=1.0, length=2),
        Segment(node_id=1, parent_id=0, value=1.0, length=3),
    ]
    assert tree_token_advantages(chain)[1].tolist() == [0.0] * 5
    flat = [Segment(node_id=i, parent_id=None, value=0.0, length=1) for i in range(4)]
    assert all(a.tolist() == [0.0] for a in tree_token_advantages(flat).values())


def test_a_flat_tree_equals_group_advantages() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    flat = [Segment(node_id=i, parent_id=None, value=r, length=2) for i, r in enumerate(rewards)]
    group, _ = group_advantages(torch.tensor([rewards]))
    adv = tree_token_advantages(flat)
    for i in range(5):
        assert adv[i].tolist() == pytest.approx([2 * group[0, i].item()] * 2, rel=1e-5)


def test_any_row_with_the_four_fields_is_a_segment() -> None:
    row = namedtuple("row", "node_id parent_id value visits start length")
    rows = [row(s.node_id, s.parent_id, s.value, 1, 0, s.length) for s in _example_tree()]
    expected = tree_token_advantages(_example_tree())
    assert all(torch.equal(a, expected[k]) for k, a in tree_token_advantages(rows).items())


def test_malformed_trees_are_refused() -> None:
    with pytest.raises(ValueError, match="^segments: node ids must be unique$"):
        leaf_paths([Segment(node_id=1, parent_id=None, value=0, length=1)] * 2)
    with pytest.raises(ValueError, match="name no segment"):
        leaf_paths([Segment(node_id=1, parent_id=7, value=0, length=1)])
    cycle = [
        Segment(node_id=1, parent_id=2, value=0, length=1),
        Segment(node_id=2, parent_id=1, value=0, length=1),
        Segment(node_id=3, parent_id=1, value=0, length=1),
    ]
    with pytest.raises(ValueError, match="cycle"):
        leaf_paths(cycle)


# --- loss ---------------------------------------------------------------------------------------


def _batch(seed: int, b: int = 4, t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[0] = 0.0  # one sequence without tokens
    mask[1, 0] = 1.0
    return {
        "logprobs": logp,
        "old_logprobs": logp + (torch.rand(b, t, generator=g) - 0.5) * 0.6,
        "ref_logprobs": logp + (torch.rand(b, t, generator=g) - 0.5) * 0.6,
        "advantages": torch.randn(b, generator=g),
        "mask": mask,
    }


def _loop_loss(batch: dict[str, torch.Tensor], eps_low, eps_high, beta, loss_type, max_length):
    """The loss written token by token with Python floats."""
    lp, old, ref = (
        batch["logprobs"].tolist(),
        batch["old_logprobs"].tolist(),
        batch["ref_logprobs"].tolist(),
    )
    mask, adv = batch["mask"].tolist(), batch["advantages"].tolist()
    per_seq, total, tokens = [], 0.0, 0
    for i in range(len(lp)):
        seq_sum, seq_tokens = 0.0, 0
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            a = adv[i] if isinstance(adv[i], float) else adv[i][t]
            r = math.exp(lp[i][t] - old[i][t])
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            loss = -min(r * a, clipped * a)
            if beta:
                d = ref[i][t] - lp[i][t]
                loss += beta * (math.exp(d) - d - 1)
            seq_sum += loss
            seq_tokens += 1
        if seq_tokens:
            per_seq.append(seq_sum / seq_tokens)
        total += seq_sum
        tokens += seq_tokens
    if loss_type == "grpo":
        return sum(per_seq) / len(per_seq)
    if loss_type == "dapo":
        return total / tokens
    return total / (len(lp) * max_length)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_aggregations_match_a_loop(loss_type: str, beta: float, per_token_adv: bool) -> None:
    for seed in range(3):
        batch = _batch(seed)
        if per_token_adv:
            batch["advantages"] = torch.randn(
                batch["logprobs"].shape, generator=torch.Generator().manual_seed(seed)
            )
        max_length = 10 if loss_type == "dr_grpo" and seed == 1 else 6
        loss, stats = grpo_loss(
            **batch,
            eps_low=0.2,
            eps_high=0.28,
            beta=beta,
            loss_type=loss_type,
            max_length=max_length,
        )
        assert loss.item() == pytest.approx(
            _loop_loss(batch, 0.2, 0.28, beta, loss_type, max_length), rel=1e-5
        )
        assert stats.tokens == int(batch["mask"].sum())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_losses_weighted_by_their_global_share_are_the_global_batchs_loss(
    loss_type: str,
) -> None:
    """The GRPO stage's normaliser (grpo.steps.normaliser_sizes): split 12 rows over 2 ranks x 2
    micro batches or 1 rank x 3, each micro batch's loss times its size over the global sum adds
    up to the loss of all rows at once, so the update does not depend on dp or grad_accum (what
    a resume under another dp needs). Normalising per rank, as before, does not."""
    import numpy as np

    from stagetrain.grpo.steps import normaliser_sizes

    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 6, 3, 0, 2, 4, 6, 1, 5, 3, 2]
    keep = [True] * 3 + [False] * 3 + [True] * 6  # rank 0 of two keeps half as much as rank 1
    items = [([0], [7] * n) for n in lengths]
    mask = torch.tensor(
        [[float(t < n and k) for t in range(6)] for n, k in zip(lengths, keep, strict=True)]
    )
    batch = {
        "logprobs": -torch.rand(12, 6, generator=g) * 3,
        "advantages": torch.randn(12, generator=g),
    }
    batch["old_logprobs"] = batch["logprobs"] + (torch.rand(12, 6, generator=g) - 0.5) * 0.6

    def loss(rows: np.ndarray) -> float:
        part = {k: v[torch.as_tensor(rows)] for k, v in batch.items()}
        return grpo_loss(**part, ref_logprobs=None, mask=mask[torch.as_tensor(rows)], eps_low=0.2,
                         eps_high=0.28, beta=0.0, loss_type=loss_type, max_length=6)[0].item()  # fmt: skip

    whole = loss(np.arange(12))
    two_ranks = [np.array_split(np.arange(6), 2), np.array_split(np.arange(6, 12), 2)]
    for ranks in (two_ranks, [np.array_split(np.arange(12), 3)]):
        chunks = [c for rank in ranks for c in rank]
        sizes = normaliser_sizes(chunks, keep, items, loss_type)
        shares = [n / sum(sizes) for n in sizes]
        assert sum(loss(c) * w for c, w in zip(chunks, shares, strict=True)) == pytest.approx(whole)

    def rank_normalised(chunks: list[np.ndarray]) -> float:
        sizes = normaliser_sizes(chunks, keep, items, loss_type)
        return sum(loss(c) * n / sum(sizes) for c, n in zip(chunks, sizes, strict=True))

    old = np.mean([rank_normalised(rank) for rank in two_ranks])  # DeepSpeed averages over dp
    if loss_type != "dr_grpo":  # rows: every rank holds as many
        assert old != pytest.approx(whole)


def test_ratio_one_is_the_policy_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    adv, mask = torch.tensor([0.5, -2.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, stats = grpo_loss(
        logp, logp.detach(), None, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0, loss_type="grpo"
    )
    assert loss.item() == pytest.approx(-(0.5 - 2.0) / 2)
    assert stats.clip_ratio_low == stats.clip_ratio_high == 0.0
    loss.backward()
    # d/dlogp of -ratio * A at ratio 1 is -A, over the sequence's tokens, over sequences.
    expected = torch.tensor([[-0.5 / 2, -0.5 / 2, 0.0], [2.0 / 3, 2.0 / 3, 2.0 / 3]]) / 2
    assert torch.allclose(logp.grad, expected)


def test_clip_stats_count_only_the_active_side() -> None:
    ratios = torch.tensor([[0.5, 0.5, 1.5, 1.5, 1.0], [0.5, 0.5, 1.5, 1.5, 1.0]])
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0], [-1.0, -1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 1.0]])
    old = torch.zeros(2, 5)
    loss, stats = grpo_loss(
        ratios.log(), old, None, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0, loss_type="dapo"
    )
    # Low: ratio 0.5 with A < 0 -> (0,0), (1,0), (1,1). High: ratio 1.5 with A > 0 -> (0,2), (1,2).
    assert stats.tokens == 9
    assert stats.clip_ratio_low == pytest.approx(3 / 9)
    assert stats.clip_ratio_high == pytest.approx(2 / 9)
    # Clipped tokens contribute their clipped value: -0.8 * -1 = 0.8, -1.2 * 1 = -1.2.
    per_token = [0.8, -0.5, -1.2, 1.5, -1.0, 0.8, 0.8, -1.2, -1.0]
    assert loss.item() == pytest.approx(sum(per_token) / 9)


def test_kl_is_k3_nonnegative_and_zero_at_the_reference() -> None:
    b = _batch(5)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.1, "loss_type": "dapo"}
    _, stats = grpo_loss(
        b["logprobs"], b["old_logprobs"], b["ref_logprobs"], b["advantages"], b["mask"], **kw
    )
    assert stats.kl_mean is not None and stats.kl_mean > 0
    _, same = grpo_loss(
        b["logprobs"], b["old_logprobs"], b["logprobs"], b["advantages"], b["mask"], **kw
    )
    assert same.kl_mean == 0.0
    # k3 of a single token, by hand.
    one = torch.ones(1, 1)
    _, stats = grpo_loss(-one, -one, -one + 0.5, torch.zeros(1), one, **kw)
    assert stats.kl_mean == pytest.approx(math.exp(0.5) - 0.5 - 1)


def test_beta_zero_ignores_the_reference() -> None:
    b = _batch(6)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "grpo"}
    with_ref, stats = grpo_loss(**b, **kw)
    b["ref_logprobs"] = torch.full_like(b["logprobs"], float("nan"))
    nan_ref, _ = grpo_loss(**b, **kw)
    b["ref_logprobs"] = None
    no_ref, _ = grpo_loss(**b, **kw)
    assert stats.kl_mean is None
    assert with_ref.item() == nan_ref.item() == no_ref.item()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gradient_is_finite_even_with_empty_sequences_and_garbage_padding(loss_type: str) -> None:
    b = _batch(7)
    b["logprobs"] = b["logprobs"].masked_fill(b["mask"] == 0, float("inf")).requires_grad_()
    b["old_logprobs"] = b["old_logprobs"].masked_fill(b["mask"] == 0, float("-inf"))
    loss, stats = grpo_loss(**b, eps_low=0.2, eps_high=0.28, beta=0.04, loss_type=loss_type)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(stats.kl_mean)
    assert torch.isfinite(b["logprobs"].grad).all()
    assert (b["logprobs"].grad[b["mask"] == 0] == 0).all()
    assert (b["logprobs"].grad[b["mask"] == 1] != 0).any()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_an_empty_batch_gives_zero_loss(loss_type: str) -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = grpo_loss(
        logp,
        torch.zeros(2, 3),
        None,
        torch.ones(2),
        torch.zeros(2, 3),
        eps_low=0.2,
        eps_high=0.2,
        beta=0.0,
        loss_type=loss_type,
    )
    loss.backward()
    assert loss.item() == 0.0 and stats.tokens == 0 and stats.clip_ratio_low == 0.0


def test_masking_a_sequence_out_equals_dropping_it_for_grpo() -> None:
    b = _batch(8)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "grpo"}
    masked, _ = grpo_loss(**b, **kw)  # row 0 has no tokens
    dropped, _ = grpo_loss(**{k: v[1:] for k, v in b.items()}, **kw)
    assert masked.item() == pytest.approx(dropped.item())


def test_bad_loss_arguments_are_refused() -> None:
    b = _batch(9)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "grpo"}
    with pytest.raises(
        StageError, match=r"^grpo\.loss_type: must be one of grpo, dapo, dr_grpo \(got 'ppo'\)$"
    ):
        grpo_loss(**b, **{**kw, "loss_type": "ppo"})
    with pytest.raises(StageError, match=r"^grpo\.kl_coef: "):
        grpo_loss(**{**b, "ref_logprobs": None}, **{**kw, "beta": 0.1})
    with pytest.raises(ValueError, match="advantages shaped"):
        grpo_loss(**{**b, "advantages": torch.zeros(3)}, **kw)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_a_single_token_is_its_own_loss_under_every_aggregation(loss_type: str) -> None:
    # One sequence of one token, ratio 1: the loss is -A, not A spread over a floor of tokens.
    one = torch.ones(1, 1)
    loss, stats = grpo_loss(
        -one,
        -one,
        None,
        torch.tensor([2.0]),
        one,
        eps_low=0.2,
        eps_high=0.2,
        beta=0.0,
        loss_type=loss_type,
    )
    assert loss.item() == pytest.approx(-2.0) and stats.tokens == 1


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("eps_low", -0.1, r"^grpo\.clip_eps_low: must be in \[0, 1\) \(got -0\.1\)$"),
        ("eps_low", 1.0, r"^grpo\.clip_eps_low: must be in \[0, 1\) \(got 1\.0\)$"),
        ("eps_low", 1.5, r"^grpo\.clip_eps_low: must be in \[0, 1\) \(got 1\.5\)$"),
        ("eps_high", -0.1, r"^grpo\.clip_eps_high: must be >= 0 \(got -0\.1\)$"),
        ("beta", -0.1, r"^grpo\.kl_coef: must be >= 0 \(got -0\.1\)$"),
        ("max_length", 0, r"^grpo\.max_new_tokens: must be >= 1 \(got 0\)$"),
    ],
)
def test_loss_settings_out_of_range_are_refused_naming_the_key(
    setting: str, value: float, message: str
) -> None:
    b = _batch(10)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "grpo", setting: value}
    with pytest.raises(StageError, match=message):
        grpo_loss(**b, **kw)


def test_loss_settings_at_their_bounds_are_accepted() -> None:
    b = _batch(11)
    loss, _ = grpo_loss(
        **b, eps_low=0.0, eps_high=0.0, beta=0.0, loss_type="dr_grpo", max_length=b["mask"].shape[1]
    )
    assert math.isfinite(loss.item())
    one = torch.ones(1, 1)
    loss, _ = grpo_loss(
        -one,
        -one,
        None,
        torch.ones(1),
        one,
        eps_low=0.2,
        eps_high=0.2,
        beta=0.0,
        loss_type="dr_grpo",
        max_length=1,
    )
    assert loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("name", ["old_logprobs", "ref_logprobs", "mask", "token_weights"])
def test_inputs_not_shaped_as_the_logprobs_are_refused_even_where_they_would_broadcast(
    name: str,
) -> None:
    b = _batch(12)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.1, "loss_type": "grpo"}
    b["token_weights"] = torch.ones_like(b["logprobs"])
    b[name] = b[name][:1]  # (1, T): broadcasts against (B, T)
    t = b["logprobs"].shape[1]
    with pytest.raises(ValueError, match=rf"^{name} shaped \(1, {t}\), logprobs \(4, {t}\)$"):
        grpo_loss(**b, **kw)
    with pytest.raises(ValueError, match=r"^logprobs must be shaped \(B, T\), got \(3,\)$"):
        grpo_loss(
            torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), **kw
        )


def test_the_loss_is_computed_in_the_logprobs_dtype() -> None:
    b = _batch(13)
    b["advantages"] = b["advantages"].double()
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "dapo"}
    loss, _ = grpo_loss(**b, **kw)
    assert loss.dtype == torch.float32
    b["advantages"] = b["advantages"].float()
    loss, _ = grpo_loss(
        **b, **kw, token_weights=torch.ones_like(b["logprobs"], dtype=torch.float64)
    )
    assert loss.dtype == torch.float32


def test_clip_stats_count_neither_a_ratio_on_the_bound_nor_a_token_the_clip_does_not_move() -> None:
    def clip_stats(logp: torch.Tensor, advantages: torch.Tensor, eps: float) -> LossStats:
        old = torch.zeros_like(logp)
        return grpo_loss(logp, old, None, advantages, torch.ones_like(logp), eps_low=eps,
                         eps_high=eps, beta=0.0, loss_type="dapo")[1]  # fmt: skip

    # Ratio exactly 1 with eps 0 sits on both bounds: clamp leaves it, so nothing is clipped.
    stats = clip_stats(torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), eps=0.0)
    assert stats.clip_ratio_low == stats.clip_ratio_high == 0.0
    # Outside the bounds, only the side where the clip binds counts: A < 0 low, A > 0 high.
    ratios = torch.tensor([[0.5, 0.5, 1.5, 1.5]])
    stats = clip_stats(ratios.log(), torch.tensor([[0.0, 0.5, 0.0, -0.5]]), eps=0.2)
    assert stats.clip_ratio_low == stats.clip_ratio_high == 0.0


def test_kl_mean_is_the_mean_k3_over_the_completion_tokens() -> None:
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = logp + torch.tensor([[0.5, -0.5, 7.0]])  # the last token is outside the mask
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, stats = grpo_loss(
        logp, logp, ref, torch.zeros(1), mask, eps_low=0.2, eps_high=0.2, beta=0.1, loss_type="dapo"
    )
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5)]
    assert stats.kl_mean == pytest.approx(sum(k3) / 2)


# --- curriculum ---------------------------------------------------------------------------------


def _cfg(**changes) -> CurriculumSettings:
    base = {
        "start_level": 2,
        "max_level": 3,
        "window": 4,
        "promote_at": 0.75,
        "demote_below": 0.25,
        "min_steps": 3,
        "earlier_share": 0.25,
    }
    return CurriculumSettings(**{"families": (), **base, **changes})


@pytest.fixture
def tiny_family(monkeypatch: pytest.MonkeyPatch) -> str:
    """A registered family whose own highest level is 2 (the real ones all reach 5)."""
    monkeypatch.setitem(
        FAMILIES, "tiny", Family(name="tiny", max_level=2, generate=FAMILIES["counting"].generate)
    )
    return "tiny"


def test_promotion_waits_for_min_steps_and_a_full_window() -> None:
    cfg, state = _cfg(), CurriculumState.start(_cfg(), "arithmetic")
    assert update(state, cfg, 1, [1.0, 1.0, 1.0, 1.0, 1.0]) is None  # window full, step 1 < 3
    assert state.recent == [1, 1, 1, 1]
    assert update(state, cfg, 2, [1.0]) is None  # step 2 < 3
    event = update(state, cfg, 3, [0.0])  # window 1, 1, 1, 0: rate 0.75 >= 0.75
    assert event == {
        "step": 3,
        "family": "arithmetic",
        "kind": "promote",
        "from": 2,
        "to": 3,
        "success_rate": 0.75,
        "window": 4,
    }
    assert (
        state.level == 3
        and state.steps_at_level == 0
        and state.recent == []
        and state.events == [event]
    )
    for step in range(4, 7):  # min_steps passed, window not full
        assert update(state, cfg, step, [1.0]) is None
    assert update(state, cfg, 7, [1.0]) is None  # full and perfect, but 3 is max_level
    assert state.level == 3 and state.steps_at_level == 4


def test_demotion_goes_below_the_start_level_down_to_one() -> None:
    cfg, state = _cfg(min_steps=1), CurriculumState.start(_cfg(), "counting")
    assert update(state, cfg, 10, [0.0, 0.5, 0.99, 1.0]) == {
        "step": 10,
        "family": "counting",
        "kind": "demote",
        "from": 2,
        "to": 1,
        "success_rate": 0.25,
        "window": 4,
    }
    assert update(state, cfg, 11, [0.0] * 4) is None  # level 1 is the floor
    assert state.level == 1 and len(state.events) == 1


def test_a_middling_success_rate_keeps_the_level() -> None:
    cfg, state = _cfg(min_steps=1), CurriculumState.start(_cfg(), "comparison")
    for step in range(10):
        assert update(state, cfg, step, [1.0, 0.0]) is None
    assert state.level == 2 and state.steps_at_level == 10 and len(state.recent) == 4
    assert window_rate(state) == 0.5 and window_rate(CurriculumState(family="x", level=1)) is None


def test_a_family_stops_at_its_own_top_level(tiny_family: str) -> None:
    cfg = _cfg(start_level=3, max_level=5, min_steps=1)
    assert top_level(cfg, tiny_family) == 2 and top_level(cfg, "arithmetic") == 5
    state = CurriculumState.start(cfg, tiny_family)
    assert state.level == 2  # start_level 3 is above the family's top
    assert update(state, cfg, 1, [1.0] * 4) is None  # perfect, but 2 is the family's top
    with pytest.raises(StageError, match="unknown family 'nope'"):
        CurriculumState.start(cfg, "nope")


def test_state_round_trips_through_json() -> None:
    cfg, state = _cfg(min_steps=1), CurriculumState.start(_cfg(), "arithmetic")
    update(state, cfg, 1, [1.0] * 4)
    update(state, cfg, 2, [1.0, 0.0])
    text = json.dumps(state.to_json())
    assert CurriculumState.from_json(json.loads(text)) == state


def test_levels_for_draws_earlier_levels_at_the_configured_share() -> None:
    cfg, rng = _cfg(earlier_share=0.3, max_level=5), random.Random(0)
    state = CurriculumState(family="arithmetic", level=4)
    levels = levels_for(state, cfg, 20_000, rng)
    assert set(levels) == {1, 2, 3, 4}
    earlier = [lv for lv in levels if lv < 4]
    assert len(earlier) / len(levels) == pytest.approx(0.3, abs=0.02)
    for lv in (1, 2, 3):
        assert earlier.count(lv) / len(earlier) == pytest.approx(1 / 3, abs=0.03)
    assert levels_for(state, cfg, 50, random.Random(1)) == levels_for(
        state, cfg, 50, random.Random(1)
    )
    assert levels_for(CurriculumState(family="arithmetic", level=1), cfg, 100, rng) == [1] * 100
    assert levels_for(state, _cfg(earlier_share=0.0), 100, rng) == [4] * 100


def _outcomes(family: str, level: int, successes: list[float]) -> list[tuple[str, int, float]]:
    return [(family, level, s) for s in successes]


def test_one_family_promotes_while_another_stays() -> None:
    cfg = _cfg(start_level=1, min_steps=1)
    curriculum = Curriculum.start(cfg, ["comparison", "arithmetic"])
    # Sorted, so that draws do not depend on the order of the list.
    assert list(curriculum.states) == ["arithmetic", "comparison"]
    # The mixed case the global curriculum got stuck on: one family always right, one always wrong.
    events = update_all(
        curriculum,
        cfg,
        1,
        _outcomes("comparison", 1, [1.0] * 4) + _outcomes("arithmetic", 1, [0.0] * 4),
    )
    assert events == [
        {"step": 1, "family": "comparison", "kind": "promote", "from": 1, "to": 2, "success_rate": 1.0, "window": 4}
    ]  # fmt: skip
    assert curriculum.levels() == {"arithmetic": 1, "comparison": 2}
    arithmetic = curriculum.states["arithmetic"]
    assert arithmetic.recent == [0, 0, 0, 0] and arithmetic.events == []
    assert curriculum.states["comparison"].events == events


def test_outcomes_feed_only_their_familys_current_level() -> None:
    cfg = _cfg(start_level=2, max_level=5)
    curriculum = Curriculum.start(cfg, ["arithmetic", "counting"])
    update_all(
        curriculum, cfg, 1, [("arithmetic", 2, 1.0), ("arithmetic", 1, 0.0), ("counting", 1, 1.0)]
    )
    # The level-1 prompt of arithmetic is an earlier-level one: not counted.
    assert curriculum.states["arithmetic"].recent == [1]
    assert curriculum.states["counting"].recent == []


def test_several_families_can_change_in_one_step() -> None:
    cfg = _cfg(start_level=2, min_steps=1)
    curriculum = Curriculum.start(cfg, ["arithmetic", "comparison", "counting"])
    outcomes = (
        _outcomes("arithmetic", 2, [0.0] * 4)
        + _outcomes("counting", 2, [1.0] * 4)
        + _outcomes("comparison", 2, [1.0, 0.0] * 2)
    )
    events = update_all(curriculum, cfg, 5, outcomes)
    assert [(e["family"], e["kind"], e["step"]) for e in events] == [
        ("arithmetic", "demote", 5),
        ("counting", "promote", 5),
    ]
    assert curriculum.levels() == {"arithmetic": 1, "comparison": 2, "counting": 3}


def test_a_family_with_no_prompts_this_step_still_ages() -> None:
    cfg = _cfg(start_level=1, min_steps=3)
    curriculum = Curriculum.start(cfg, ["arithmetic", "counting"])
    update_all(curriculum, cfg, 1, _outcomes("counting", 1, [1.0] * 4))
    update_all(curriculum, cfg, 2, [])  # nobody drew a prompt
    assert [s.steps_at_level for s in curriculum.states.values()] == [2, 2]
    # arithmetic's first outcomes arrive at step 3: its min_steps have passed, so it promotes at once.
    events = update_all(curriculum, cfg, 3, _outcomes("arithmetic", 1, [1.0] * 4))
    assert [(e["family"], e["step"]) for e in events] == [("arithmetic", 3), ("counting", 3)]


def test_curriculum_round_trips_through_json() -> None:
    cfg = _cfg(start_level=1, min_steps=1)
    curriculum = Curriculum.start(cfg, ["counting", "arithmetic"])
    update_all(
        curriculum,
        cfg,
        1,
        _outcomes("counting", 1, [1.0] * 4) + _outcomes("arithmetic", 1, [1.0, 0.0]),
    )
    text = json.dumps(curriculum.to_json())
    data = json.loads(text)
    assert set(data) == {"arithmetic", "counting"} and data["counting"]["level"] == 2
    assert Curriculum.from_json(data) == curriculum
    # A dict in another order gives the same curriculum, families sorted.
    reordered = Curriculum.from_json(dict(reversed(data.items())))
    assert reordered == curriculum and list(reordered.states) == ["arithmetic", "counting"]


def test_a_family_listed_twice_is_refused() -> None:
    with pytest.raises(StageError, match=r"^grpo\.curriculum\.families: "):
        Curriculum.start(_cfg(), ["counting", "counting"])


def test_draw_picks_families_uniformly_then_levels_as_levels_for(tiny_family: str) -> None:
    cfg = _cfg(start_level=1, max_level=5, earlier_share=0.3)
    curriculum = Curriculum(
        states={
            "arithmetic": CurriculumState(family="arithmetic", level=4),
            "counting": CurriculumState(family="counting", level=1),
            tiny_family: CurriculumState(family=tiny_family, level=5),  # resumed above its top of 2
        }
    )
    draws = draw(curriculum, cfg, 30_000, random.Random(0))
    assert draw(curriculum, cfg, 50, random.Random(1)) == draw(
        curriculum, cfg, 50, random.Random(1)
    )
    by_family = {f: [lv for g, lv in draws if g == f] for f in curriculum.states}
    for levels in by_family.values():
        assert len(levels) / len(draws) == pytest.approx(1 / 3, abs=0.02)
    assert set(by_family["counting"]) == {1}  # no earlier levels below 1
    arithmetic = by_family["arithmetic"]
    assert set(arithmetic) == {1, 2, 3, 4}
    assert sum(lv < 4 for lv in arithmetic) / len(arithmetic) == pytest.approx(0.3, abs=0.02)
    assert max(by_family[tiny_family]) == 2  # never above the family's own top level
    current = draw(curriculum, _cfg(max_level=5, earlier_share=0.0), 100, random.Random(2))
    assert set(current) == {("arithmetic", 4), ("counting", 1), (tiny_family, 2)}
    capped = draw(curriculum, _cfg(max_level=3, earlier_share=0.0), 100, random.Random(2))
    assert set(capped) == {("arithmetic", 3), ("counting", 1), (tiny_family, 2)}  # max_level too


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"start_level": 0}, "start_level"),
        ({"max_level": 1}, "max_level"),
        ({"window": 0}, "window"),
        ({"min_steps": 0}, "min_steps"),
        ({"promote_at": 1.5}, "promote_at"),
        ({"earlier_share": -0.1}, "earlier_share"),
        ({"demote_below": 0.75}, "demote_below"),
    ],
)
def test_bad_curriculum_config_names_the_key(changes: dict, key: str) -> None:
    with pytest.raises(StageError, match=rf"^grpo\.curriculum\.{key}: "):
        _cfg(**changes)


def test_token_weights_scale_each_tokens_policy_gradient_and_not_its_kl() -> None:
    """The sampler correction's weights multiply the clipped policy-gradient term of their token
    only: weight 0 removes a token's pull, weight 2 doubles it, the KL term is left alone."""
    torch.manual_seed(0)
    logprobs = torch.randn(2, 3, requires_grad=True)
    old, ref = logprobs.detach() + 0.01, logprobs.detach() - 0.2
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    weights = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]])
    common = {"eps_low": 0.2, "eps_high": 0.28, "loss_type": "dapo"}

    def grad(w: torch.Tensor | None, beta: float) -> torch.Tensor:
        loss, _ = grpo_loss(logprobs, old, ref, adv, mask, beta=beta, token_weights=w, **common)
        (g,) = torch.autograd.grad(loss, logprobs)
        return g

    plain, weighted = grad(None, 0.0), grad(weights, 0.0)
    assert torch.allclose(weighted, plain * weights)
    kl_only = grad(None, 0.5) - plain
    assert torch.allclose(grad(weights, 0.5) - weighted, kl_only)


def test_truncated_importance_is_the_capped_ratio_and_one_where_the_sampler_is_unknown() -> None:
    from stagetrain.grpo.steps import gap_sums, truncated_importance

    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    sampler = torch.tensor([[-1.0, -2.5, -2.0, float("nan")]])
    w = truncated_importance(trainer, sampler, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, math.exp(0.5), 2.0, 1.0]]))
    total, top, k3, tokens = gap_sums(trainer, sampler, torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    assert tokens == 3 and total == pytest.approx(2.0) and top == pytest.approx(1.5)
    d = torch.tensor([0.0, 0.5, 1.5], dtype=torch.float64)
    assert k3 == pytest.approx(float((d.exp() - 1 - d).sum()))
    assert gap_sums(trainer, sampler, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))[3] == 0


def test_replay_puts_its_share_of_other_families_in_each_step_and_leaves_the_curriculum() -> None:
    from stagetrain.grpo.curriculum import update_all
    from stagetrain.grpo.run import Replay
    from stagetrain.grpo.steps import step_prompts

    cfg = _cfg(start_level=1, max_level=5, earlier_share=0.0)
    curriculum = Curriculum.start(cfg, ["comparison"])
    replay = Replay(0.25, {"counting": 2})
    batches = [
        step_prompts(curriculum, cfg, prompts=16, seed=7, step=s, replay=replay) for s in range(40)
    ]
    assert all(
        sum(p.family == "counting" for p in b) == 4 for b in batches
    )  # exactly round(0.25 * 16)
    assert {p.level for b in batches for p in b if p.family == "counting"} == {1, 2}
    assert {p.level for b in batches for p in b if p.family == "comparison"} == {1}
    assert step_prompts(curriculum, cfg, prompts=16, seed=7, step=3, replay=replay) == batches[3]
    plain = step_prompts(curriculum, cfg, prompts=16, seed=7, step=3)
    assert all(p.family == "comparison" for p in plain)
    # A replayed family's outcomes never reach the curriculum (it has no state there).
    update_all(curriculum, cfg, 1, [("counting", 1, 1.0)] * 16 + [("comparison", 1, 0.0)])
    assert set(curriculum.states) == {"comparison"}
    assert curriculum.states["comparison"].recent == [0]


@pytest.mark.parametrize(("share", "prompts"), [(0.1, 4), (0.375, 4), (0.3, 16)])
def test_replay_holds_its_share_in_expectation_where_rounding_would_not(
    share: float, prompts: int
) -> None:
    """Rounding replayed none of 4 prompts at 0.1 and half of them at 0.375: a step replays the
    share's whole prompts and one more with the chance of the fraction, so over many steps the
    share is the one asked for, each step within one prompt of it."""
    from stagetrain.grpo.run import Replay
    from stagetrain.grpo.steps import step_prompts

    cfg = _cfg(start_level=1, max_level=5, earlier_share=0.0)
    curriculum = Curriculum.start(cfg, ["comparison"])
    counts = [
        sum(p.family == "counting" for p in step_prompts(curriculum, cfg, prompts=prompts, seed=3, step=s,
                                                          replay=Replay(share, {"counting": 1})))
        for s in range(2000)
    ]  # fmt: skip
    exact = share * prompts
    assert set(counts) == {math.floor(exact), math.floor(exact) + 1}
    assert sum(counts) / len(counts) / prompts == pytest.approx(share, abs=0.02)


def test_each_reward_term_is_logged_by_name_as_trl_does_its_none_rows_left_out() -> None:
    from stagetrain.grpo.steps import by_reward
    from stagetrain.training.metrics import scalars

    terms = [("accuracy_reward", 1.0), ("accuracy_reward", 0.0), ("format", math.nan), ("format", 0.5),
             ("accuracy_reward", 1.0), ("only_none", math.nan)]  # fmt: skip
    got = by_reward(terms)
    assert got == {"accuracy_reward": {"mean": pytest.approx(2 / 3), "std": pytest.approx(math.sqrt(2) / 3)},
                   "format": {"mean": 0.5, "std": 0.0}}  # fmt: skip
    flat = scalars({"step": 1, "rewards": got})  # type: ignore[typeddict-unknown-key]
    assert flat == {"rewards/accuracy_reward/mean": pytest.approx(2 / 3), "rewards/accuracy_reward/std": pytest.approx(math.sqrt(2) / 3),
                    "rewards/format/mean": 0.5, "rewards/format/std": 0.0}  # fmt: skip


def test_a_run_that_solved_nothing_is_warned_with_its_largest_reward() -> None:
    from stagetrain.grpo.train import nothing_solved

    unsolved = [{"step": 0}] + [
        {"step": s, "reward/solved": 0.0, "reward/max": m} for s, m in ((1, 0.5), (2, 1.5))
    ]
    message = nothing_solved(unsolved)  # type: ignore[arg-type]
    assert message is not None and "in 2 logged steps (the largest reward was 1.5)" in message
    assert "tasks.success_at" in message and "\n" not in message
    assert (
        nothing_solved([*unsolved, {"step": 3, "reward/solved": 0.125, "reward/max": 2.0}]) is None
    )  # type: ignore[list-item]
    assert nothing_solved([{"step": 0}]) is None  # type: ignore[list-item]


@pytest.mark.slow
def test_train_on_makes_the_global_batchs_update_however_dp_and_accumulation_cut_it(
    tmp_path: Path,
) -> None:
    """The stage's own `train_on` through DeepSpeed (tests/dist/grpo_normaliser.py): 2 ranks x 2
    micro batches and 1 rank x 3 of one global batch give the same weights, under SGD, whose
    update is the gradient itself. A per-rank normaliser weighs the ranks' kept tokens apart."""
    weights = {}
    for dp, ga in ((2, 2), (1, 3)):
        out = tmp_path / f"dp{dp}"
        out.mkdir()
        proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node",
                               str(dp), str(REPO / "tests/dist/grpo_normaliser.py"), str(out), str(ga)],
                              cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[dp] = torch.load(out / "weights.pt")
    assert max((weights[1][k] - weights[2][k]).abs().max().item() for k in weights[1]) < 1e-6
    torch.manual_seed(0)
    start = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32)).state_dict()  # fmt: skip
    assert max((weights[1][k] - start[k]).abs().max().item() for k in start) > 1e-3  # it stepped
