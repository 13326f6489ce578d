"""Advantages for GRPO: per group of completions, and per token for the tree (MCTS) mode.

GRPO has no value network: a completion's advantage is its reward compared with
the other completions of the same prompt (DeepSeekMath, Shao et al. 2024):

    A_i = (r_i - mean(r)) / (std(r) + eps)

with the sample standard deviation (divisor G - 1, torch.std's default, as TRL
computes it). A group whose rewards are all equal carries no signal: its
advantages are exactly 0, and `group_advantages` flags it so the caller drops it
from the loss and logs the share of such groups (TRL's frac_reward_zero_std).

Tree mode. The completions of one prompt form a tree: the root is the prompt,
each other node owns a segment of tokens, and a completion is the path from the
root to a leaf. A node's value is the mean reward of the leaves under it (a
leaf's value is its reward). The advantage of a token in segment s on the path
to leaf l is

    A(token) = sib(s) + leaf(l)
    sib(s)   = (v_s - mean(v_siblings)) / (std(v_siblings) + eps)   over s and its siblings
    leaf(l)  = (r_l - mean(r_leaves)) / (std(r_leaves) + eps)       over all leaves of the prompt

with the same formula (sample std, exactly 0 for a single child or all-equal
values) at both levels: the sibling term credits the choice made at each
branching point, the leaf term the completion as a whole. The module takes the
tree as a flat list of rows with those four fields (`SegmentLike`, such as the
search's `TreeSegment`), so it does not depend on the search code.

Worked example (eps ignored; eps = 1e-4 moves the 4th decimal). The root has
children A (3 tokens) and B (4 tokens, a leaf, reward 1); A has leaves A1
(2 tokens, reward 1) and A2 (1 token, reward 0). So v_A = 0.5, v_B = 1.

    sib(A), sib(B)   = -0.7071, +0.7071   (mean 0.75, std 0.3536)
    sib(A1), sib(A2) = +0.7071, -0.7071   (mean 0.5, std 0.7071)
    leaf(A1, A2, B)  = +0.5774, -1.1547, +0.5774   (mean 2/3, std 0.5774)

    path to A1: [-0.1298] * 3 + [1.2845] * 2
    path to A2: [-1.8618] * 3 + [-1.8618] * 1
    path to B:  [1.2845] * 4
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

from stagetrain.errors import StageError

NodeId = Hashable


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages of rewards shaped (groups, G), and the zero-std mask.

    A[g, i] = (r[g, i] - mean_i r[g]) / (std_i r[g] + eps), std with divisor G - 1.
    Returns (advantages (groups, G), zero_std (groups,) bool): zero_std marks the
    groups whose rewards are all equal; their advantages are exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped (groups, group_size), got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise StageError(
            f"grpo.group_size: group-relative advantages need at least 2 completions per prompt (got {rewards.shape[1]})"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    zero_std = (rewards == rewards[:, :1]).all(dim=1)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    advantages = (rewards - mean) / (std + eps)
    return torch.where(zero_std[:, None], torch.zeros_like(advantages), advantages), zero_std


def sibling_advantages(values: Sequence[float], eps: float = 1e-4) -> list[float]:
    """Each value normalised among all of them: (v - mean) / (std + eps), sample std.

    0 for every value when there is a single one or they are all equal.
    """
    if len(values) < 2:
        return [0.0] * len(values)
    advantages, _ = group_advantages(torch.tensor([list(values)], dtype=torch.float64), eps)
    return advantages[0].tolist()


class SegmentLike(Protocol):
    """What the functions below read of a segment: one node of a prompt's completion tree
    below the root (`parent_id` None for a child of the root), `value` the mean reward of
    the leaves under it (a leaf's reward), `length` the tokens it adds. The search's
    `grpo.tree.TreeSegment` is one."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def parent_id(self) -> NodeId | None: ...
    @property
    def value(self) -> float: ...
    @property
    def length(self) -> int: ...


def leaf_paths(segments: Sequence[SegmentLike]) -> dict[NodeId, list[SegmentLike]]:
    """For each leaf (a node no segment names as parent), its segments from the root down."""
    by_id = {s.node_id: s for s in segments}
    if len(by_id) != len(segments):
        raise ValueError("segments: node ids must be unique")
    parents = {s.parent_id for s in segments}
    missing = parents - set(by_id) - {None}
    if missing:
        raise ValueError(f"segments: parent ids {sorted(map(repr, missing))} name no segment")
    paths: dict[NodeId, list[SegmentLike]] = {}
    for leaf in (s for s in segments if s.node_id not in parents):
        path = [leaf]
        while path[-1].parent_id is not None:
            if len(path) > len(segments):
                raise ValueError(f"segments: the path to leaf {leaf.node_id!r} has a cycle")
            path.append(by_id[path[-1].parent_id])
        paths[leaf.node_id] = path[::-1]
    return paths


def node_advantages(segments: Sequence[SegmentLike], eps: float = 1e-4) -> dict[NodeId, float]:
    """sib(s) for every segment: its value normalised among the children of its parent."""
    children: dict[NodeId | None, list[SegmentLike]] = {}
    for s in segments:
        children.setdefault(s.parent_id, []).append(s)
    out: dict[NodeId, float] = {}
    for group in children.values():
        adv = sibling_advantages([s.value for s in group], eps)
        out.update(zip((s.node_id for s in group), adv, strict=True))
    return out


def tree_token_advantages(
    segments: Sequence[SegmentLike], eps: float = 1e-4
) -> dict[NodeId, torch.Tensor]:
    """Per leaf, the advantage of each token of its completion, root to leaf.

    A(token in s on the path to l) = sib(s) + leaf(l) (see the module docstring).
    The tensor (float32, length = sum of the path's segment lengths) lines up
    with the tokens of the path's segments concatenated in `leaf_paths` order.
    """
    paths = leaf_paths(segments)
    sib = node_advantages(segments, eps)
    leaf_ids = list(paths)
    leaf = dict(
        zip(leaf_ids, sibling_advantages([paths[i][-1].value for i in leaf_ids], eps), strict=True)
    )
    return {
        i: torch.cat(
            [torch.full((s.length,), sib[s.node_id] + leaf[i], dtype=torch.float32) for s in path]
        )
        for i, path in paths.items()
    }
