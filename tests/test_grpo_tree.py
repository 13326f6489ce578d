"""The MCTS tree of the GRPO stage: UCT selection, backup, budgets and the export, with fake callbacks."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest

from stagetrain.errors import StageError
from stagetrain.grpo.tree import (
    Node,
    Request,
    SearchTree,
    TreeConfig,
    flat_equivalent_tokens,
    search,
    search_trees,
    segments,
    through_eos,
)

EOS = 0


def _cfg(**changes: Any) -> TreeConfig:
    base = TreeConfig(
        branching=2,
        segment_tokens=3,
        max_leaves=8,
        max_tokens=1000,
        max_new_tokens=12,
        uct_c=1.0,
        eos_id=EOS,
    )
    return replace(base, **changes)


def _fake_expand(calls: list[tuple[list[list[int]], int, int]] | None = None):
    """Deterministic continuations: token values from the prefix; some end with eos."""

    def expand(prefixes: list[list[int]], b: int, k: int) -> list[list[int]]:
        if calls is not None:
            calls.append(([list(p) for p in prefixes], b, k))
        out = []
        for prefix in prefixes:
            for i in range(b):
                seed = (31 * sum(prefix) + 17 * len(prefix) + 7 * i) % 101
                tokens = [(seed + 5 * j) % 9 + 1 for j in range(k)]
                if seed % 4 == 0:
                    tokens[-1] = EOS
                out.append(tokens)
        return out

    return expand


def _even_score(completion: list[int]) -> float:
    """1.0 when the last token before eos is even."""
    body = completion[:-1] if completion[-1] == EOS else completion
    return 1.0 if body and body[-1] % 2 == 0 else 0.0


def _grow(tree: SearchTree, node: Node, *continuations: list[int]) -> list[Node]:
    return tree.expand(node, list(continuations))


# --- selection -------------------------------------------------------------------------------


def test_unvisited_children_are_selected_first_in_creation_order() -> None:
    tree = SearchTree(_cfg())
    a, b, c = _grow(tree, tree.root, [1], [2], [3])
    assert tree.select() is a
    (leaf, _) = _grow(tree, a, [4, EOS], [5])
    tree.backup(leaf, 1.0)
    assert tree.select() is b  # unvisited beats a's finite UCT (1 + 0)
    (leaf, _) = _grow(tree, b, [6, EOS], [7])
    tree.backup(leaf, 1.0)
    assert tree.select() is c


def _two_branch_tree(uct_c: float) -> tuple[SearchTree, dict[str, Node]]:
    """root -> A (3 leaves: 1, 0, 0; open child a3), B (1 leaf: 0; open child b2)."""
    tree = SearchTree(_cfg(uct_c=uct_c))
    a, b = _grow(tree, tree.root, [1], [2])
    a1, a2, a3, a4 = _grow(tree, a, [EOS], [3, EOS], [4, EOS], [5])
    b1, b2 = _grow(tree, b, [EOS], [6])
    for leaf, reward in ((a1, 1.0), (a2, 0.0), (a3, 0.0), (b1, 0.0)):
        tree.backup(leaf, reward)
    return tree, {"a": a, "b": b, "a4": a4, "b2": b2}


def test_exploration_term_makes_the_less_visited_child_win() -> None:
    tree, n = _two_branch_tree(uct_c=1.0)
    # By hand: root visits 4, ln 4 = 1.386294; A = 1/3 + sqrt(ln 4 / 3), B = 0 + sqrt(ln 4 / 1).
    assert tree.uct(tree.root, n["a"]) == pytest.approx(1.0131113, abs=1e-7)
    assert tree.uct(tree.root, n["b"]) == pytest.approx(1.1774100, abs=1e-7)
    assert tree.select() is n["b2"]


def test_without_exploration_the_higher_mean_wins() -> None:
    tree, n = _two_branch_tree(uct_c=0.0)
    assert tree.uct(tree.root, n["a"]) == pytest.approx(1 / 3)
    assert tree.select() is n["a4"]


def test_finished_leaves_are_never_selected_and_a_closed_tree_selects_none() -> None:
    tree = SearchTree(_cfg())
    a, b = _grow(tree, tree.root, [1, EOS], [2])
    tree.backup(a, 5.0)  # a high value must not attract selection to a finished leaf
    assert tree.select() is b
    _grow(tree, b, [3, EOS], [4, EOS])
    assert tree.select() is None


# --- backup, completion, expansion -----------------------------------------------------------


def test_backup_makes_each_value_the_mean_reward_of_the_leaves_under_it() -> None:
    tree = SearchTree(_cfg())
    a, b = _grow(tree, tree.root, [1], [2, EOS])
    a1, a2 = _grow(tree, a, [3, EOS], [4, EOS])
    assert a.value == 0.0 and a.visits == 0
    for leaf, reward in ((a1, 1.0), (a2, 0.0), (b, 1.0)):
        tree.backup(leaf, reward)
    assert (a.visits, a.value) == (2, 0.5)
    assert (b.visits, b.value) == (1, 1.0)
    assert tree.root.visits == 3
    assert tree.root.value == pytest.approx(2 / 3)
    assert [leaf.id for leaf in tree.leaves()] == [b.id, a1.id, a2.id]


def test_completion_concatenates_segments_from_the_root() -> None:
    tree = SearchTree(_cfg())
    (a, b) = _grow(tree, tree.root, [1, 2], [9])
    (a1, a2) = _grow(tree, a, [3, 4, 5], [6, EOS])
    (x, _) = _grow(tree, a1, [7, EOS], [8])
    assert tree.completion(tree.root) == []
    assert tree.completion(x) == [1, 2, 3, 4, 5, 7, EOS]
    assert tree.completion(a2) == [1, 2, 6, EOS]
    assert tree.path(x) == [a.id, a1.id, x.id]
    assert [tree.nodes[i] for i in tree.nodes[a.id].children] == [a1, a2]
    assert [tree.nodes[i] for i in tree.root.children] == [a, b]
    assert tree.generated_tokens == 3 + 5 + 3


def test_expand_marks_finished_at_eos_or_max_new_tokens_and_cuts_after_eos() -> None:
    tree = SearchTree(_cfg(max_new_tokens=4))
    (a, b) = _grow(tree, tree.root, [1, 2], [3, EOS, 7, 7])
    assert not a.finished
    assert b.finished and b.tokens == [3, EOS]
    assert tree.segment_limit(a) == 2  # K = 3, but only 2 tokens are left to max_new_tokens
    (a1, a2) = _grow(tree, a, [4], [5, 6])
    assert not a1.finished and a2.finished
    with pytest.raises(ValueError, match="1..1 tokens"):
        _grow(tree, a1, [8], [8, 9])
    assert a1.children == [] and tree.generated_tokens == 7  # a rejected expansion adds nothing
    with pytest.raises(ValueError, match="already expanded"):
        _grow(tree, a, [1], [1])
    with pytest.raises(ValueError, match="1..3 tokens"):
        _grow(SearchTree(_cfg()), SearchTree(_cfg()).root, [1], [])


# --- search end to end -----------------------------------------------------------------------


def test_search_respects_the_leaf_budget_and_finishes_every_leaf() -> None:
    cfg = _cfg(branching=3, max_leaves=6)
    tree = search(cfg, _fake_expand(), _even_score)
    leaves = tree.leaves()
    assert tree.select() is not None  # the budget stopped it, not a lack of nodes to expand
    assert cfg.max_leaves <= len(leaves) < cfg.max_leaves + cfg.branching
    for leaf in leaves:
        completion = tree.completion(leaf)
        assert not leaf.children and leaf.visits == 1
        assert completion[-1] == EOS or len(completion) == cfg.max_new_tokens
        assert leaf.value == _even_score(completion)
    assert all(len(tree.completion(n)) <= cfg.max_new_tokens for n in tree.nodes)
    assert tree.root.visits == len(leaves)


def test_a_probe_stops_a_tree_whose_first_leaves_agree_and_only_that_one() -> None:
    def expand(requests: list[Request], b: int, k: int) -> list[list[int]]:
        return [[2 + i % 2, EOS] for r in requests for i in range(b)]

    def score(tree: int, completion: list[int]) -> float:
        return 1.0 if tree == 0 else float(completion[0] == 2)  # tree 0 agrees, tree 1 does not

    cfg = _cfg(branching=2, max_leaves=8, probe_leaves=4)
    agree, differ = search_trees([cfg, cfg], expand, score, max_batch=4)
    assert len(agree.leaves()) == 4  # stopped after the probe: 2 widenings of 2 leaves
    assert len(differ.leaves()) == 8
    unprobed = search_trees([replace(cfg, probe_leaves=0)], expand, score, max_batch=4)[0]
    assert len(unprobed.leaves()) == 8


def test_a_probe_of_one_leaf_stops_the_tree_after_its_first_leaves() -> None:
    def expand(requests: list[Request], b: int, k: int) -> list[list[int]]:
        return [[2 + i, EOS] for r in requests for i in range(b)]

    tree = search_trees(
        [_cfg(max_leaves=8, probe_leaves=1)], expand, lambda t, c: 1.0, max_batch=4
    )[0]
    assert len(tree.leaves()) == 2  # the first round's B leaves, then the probe stops it


def test_a_tree_that_spent_its_token_budget_exactly_stops() -> None:
    def expand(prefixes: list[list[int]], b: int, k: int) -> list[list[int]]:
        return [[1] * k for _ in prefixes for _ in range(b)]

    cfg = _cfg(max_tokens=6)  # B * K: the first expansion spends it all
    tree = search(cfg, expand, _even_score)
    assert tree.generated_tokens == 6 and len(tree.nodes) == 3


def test_search_respects_the_token_budget() -> None:
    cfg = _cfg(max_leaves=1000, max_tokens=20)
    tree = search(cfg, _fake_expand(), _even_score)
    assert (
        cfg.max_tokens
        <= tree.generated_tokens
        < cfg.max_tokens + cfg.branching * cfg.segment_tokens
    )
    assert tree.generated_tokens == sum(len(n.tokens) for n in tree.nodes)


def test_search_calls_expand_once_per_iteration_with_the_segment_limit() -> None:
    calls: list[tuple[list[list[int]], int, int]] = []
    cfg = _cfg(max_new_tokens=5)
    tree = search(cfg, _fake_expand(calls), _even_score)
    expanded = [tree.nodes[tree.nodes[i].parent] for i in range(1, len(tree.nodes), cfg.branching)]
    assert len(calls) == len(expanded) and expanded.count(tree.root) > 1  # the root widened
    for (prefixes, b, k), node in zip(calls, expanded, strict=True):
        assert prefixes == [tree.completion(node)] and b == cfg.branching
        assert k == min(cfg.segment_tokens, cfg.max_new_tokens - len(prefixes[0]))


def test_sharing_prefixes_generates_fewer_tokens_than_flat_sampling() -> None:
    tree = search(_cfg(branching=3, max_leaves=16), _fake_expand(), _even_score)
    assert len(tree.leaves()) >= 16
    assert tree.generated_tokens < flat_equivalent_tokens(tree)


def test_exhaustive_search_of_a_full_binary_tree_has_exact_counts() -> None:
    """No eos, K = 1, max_new_tokens = 3: 2 + 4 + 8 nodes, 8 leaves of 3 tokens each."""
    cfg = _cfg(segment_tokens=1, max_new_tokens=3, max_leaves=8)
    scores: list[list[int]] = []

    def never_eos(prefixes: list[list[int]], b: int, k: int) -> list[list[int]]:
        return [[i + 1] * k for _ in prefixes for i in range(b)]

    def score(completion: list[int]) -> float:
        scores.append(completion)
        return float(completion[-1] == 2)

    tree = search(cfg, never_eos, score)
    assert tree.select() is None
    assert len(tree.nodes) == 15 and len(tree.leaves()) == 8
    assert tree.generated_tokens == 14 and flat_equivalent_tokens(tree) == 24
    assert sorted(scores) == sorted([[a, b, c] for a in (1, 2) for b in (1, 2) for c in (1, 2)])
    assert tree.root.value == 0.5


def test_search_is_deterministic_for_the_same_callbacks() -> None:
    first = search(_cfg(branching=3, max_leaves=10), _fake_expand(), _even_score)
    second = search(_cfg(branching=3, max_leaves=10), _fake_expand(), _even_score)
    assert [asdict(n) for n in first.nodes] == [asdict(n) for n in second.nodes]
    assert first.generated_tokens == second.generated_tokens


def test_search_rejects_a_wrong_number_of_continuations() -> None:
    with pytest.raises(ValueError, match="expected 2"):
        search(_cfg(), lambda prefixes, b, k: [[1]], _even_score)


# --- several trees in batched rounds ----------------------------------------------------------


def _batch_expand(calls: list[list[Request]] | None = None):
    """A pure batched sampler: each request's continuations depend on its tree and prefix only,
    so batching cannot change them (the real sampler's do; its path is the tree GRPO test's)."""
    single = _fake_expand()

    def expand(requests: list[Request], b: int, k: int) -> list[list[int]]:
        if calls is not None:
            calls.append(list(requests))
        out = []
        for r in requests:
            # A different prefix per tree, so that trees differ; cut back to the limit below.
            out += [c + [r.tree % 7 + 1] * k for c in single([[r.tree] + r.prefix], b, k)]
        return out

    return expand


def _tree_score(tree: int, completion: list[int]) -> float:
    return _even_score(completion) if tree % 2 else 1.0 - _even_score(completion)


def _alone(cfg: TreeConfig, index: int) -> SearchTree:
    """Tree `index` grown by itself, one node per call."""
    expand = _batch_expand()

    def one(prefixes: list[list[int]], b: int, k: int) -> list[list[int]]:
        return expand([Request(tree=index, prefix=p, limit=k) for p in prefixes], b, k)

    return search(cfg, one, lambda completion: _tree_score(index, completion))


def test_trees_grown_together_equal_each_tree_grown_alone() -> None:
    cfgs = [_cfg(max_leaves=6), _cfg(max_leaves=100, max_tokens=15), _cfg(max_new_tokens=5)]
    together = search_trees(cfgs, _batch_expand(), _tree_score, max_batch=64)
    assert len({len(t.nodes) for t in together}) > 1  # the trees differ
    for i, (cfg, tree) in enumerate(zip(cfgs, together, strict=True)):
        assert [asdict(n) for n in tree.nodes] == [asdict(n) for n in _alone(cfg, i).nodes]


def test_a_round_is_one_call_for_every_open_tree_within_the_generation_batch() -> None:
    cfgs = [_cfg(max_leaves=4 + 2 * i) for i in range(5)]
    calls: list[list[Request]] = []
    trees = search_trees(cfgs, _batch_expand(calls), _tree_score, max_batch=64)
    expansions = [(len(t.nodes) - 1) // 2 for t in trees]
    assert len(calls) == max(expansions)  # one call per round: the longest search's rounds
    assert [len(c) for c in calls] == [sum(e > r for e in expansions) for r in range(len(calls))]
    assert all(len({r.tree for r in call}) == len(call) for call in calls)  # a node per tree
    capped: list[list[Request]] = []
    again = search_trees(cfgs, _batch_expand(capped), _tree_score, max_batch=5)
    assert max(len(call) for call in capped) == 2  # 5 // B sequences' worth of nodes
    assert sum(map(len, capped)) == sum(expansions)
    assert [[asdict(n) for n in t.nodes] for t in again] == [
        [asdict(n) for n in t.nodes] for t in trees
    ]


def test_a_generation_batch_smaller_than_two_nodes_expands_one_node_per_call() -> None:
    calls: list[list[Request]] = []
    search_trees([_cfg(max_leaves=4)] * 3, _batch_expand(calls), _tree_score, max_batch=3)
    assert calls and all(len(call) == 1 for call in calls)  # 3 // B = 1 node: B sequences


def test_through_eos_keeps_the_tokens_up_to_and_including_the_first_eos() -> None:
    assert through_eos([5, EOS, 6, EOS], EOS) == [5, EOS]
    assert through_eos([EOS, 6], EOS) == [EOS]
    assert through_eos([5, 6], EOS) == [5, 6]


def test_continuations_are_cut_to_each_nodes_own_limit() -> None:
    """One call asks for the longest limit; a node near max_new_tokens keeps fewer tokens."""
    cfgs = [_cfg(max_new_tokens=4, max_leaves=100), _cfg(max_new_tokens=12, max_leaves=100)]
    calls: list[list[Request]] = []
    trees = search_trees(cfgs, _batch_expand(calls), _tree_score, max_batch=64)
    assert any(len({r.limit for r in call}) > 1 for call in calls)
    assert len(trees[0].root.children) > 2  # every path within 4 tokens ended: it widened
    for tree in trees:
        assert all(len(tree.completion(n)) <= tree.cfg.max_new_tokens for n in tree.nodes)
        assert all(
            leaf.tokens[-1] == EOS or len(tree.completion(leaf)) == tree.cfg.max_new_tokens
            for leaf in tree.leaves()
        )


def test_a_tree_whose_paths_all_end_widens_its_root_until_its_leaf_budget() -> None:
    """Answers that end within one segment: without widening the group would be B leaves."""
    cfg = _cfg(max_leaves=8)

    def short(prefixes: list[list[int]], b: int, k: int) -> list[list[int]]:
        return [[3 + i, EOS] for _ in prefixes for i in range(b)]

    tree = search(cfg, short, _even_score)
    assert len(tree.leaves()) == 8 and len(tree.root.children) == 8
    assert tree.generated_tokens == 16 == flat_equivalent_tokens(tree)  # flat sampling, no sharing
    assert tree.root.visits == 8 and tree.root.value == 0.5
    with pytest.raises(ValueError, match="already expanded"):
        tree.expand(tree.nodes[1], [[1]])  # a finished leaf never widens
    widened = SearchTree(cfg)
    _grow(widened, widened.root, [3, EOS], [4, EOS])
    assert widened.closed
    new = _grow(widened, widened.root, [1], [2])  # widening with unfinished children reopens it
    assert not widened.closed and widened.select() is new[0]
    open_tree = SearchTree(cfg)
    _grow(open_tree, open_tree.root, [1], [2])
    with pytest.raises(ValueError, match="already expanded"):
        _grow(open_tree, open_tree.root, [3], [4])  # an open root is not widened


def test_search_trees_rejects_mixed_branching_and_a_wrong_number_of_continuations() -> None:
    with pytest.raises(ValueError, match="^search_trees: every tree must have the same branching$"):
        search_trees([_cfg(), _cfg(branching=3)], _batch_expand(), _tree_score, max_batch=8)
    with pytest.raises(ValueError, match="expected 4"):
        search_trees([_cfg(), _cfg()], lambda r, b, k: [[1]] * 3, _tree_score, max_batch=8)


# --- export ----------------------------------------------------------------------------------


def test_segments_export_scored_nodes_and_leaf_paths() -> None:
    tree = SearchTree(_cfg())
    a, b, c = _grow(tree, tree.root, [1, 2], [3, EOS], [4])  # c is never scored
    a1, a2 = _grow(tree, a, [5, 6, EOS], [7])  # a2 is never scored
    tree.backup(a1, 1.0)
    tree.backup(b, 0.0)
    rows, paths = segments(tree)
    got = [(r.node_id, r.parent_id, r.value, r.visits, r.start, r.length) for r in rows]
    assert got == [
        (a.id, None, 1.0, 1, 0, 2),
        (b.id, None, 0.0, 1, 0, 2),
        (a1.id, a.id, 1.0, 1, 2, 3),
    ]
    assert paths == [[b.id], [a.id, a1.id]]


def test_segments_of_a_search_cover_every_leaf_path() -> None:
    tree = search(_cfg(branching=3, max_leaves=10), _fake_expand(), _even_score)
    rows, paths = segments(tree)
    by_id = {r.node_id: r for r in rows}
    assert len(paths) == len(tree.leaves())
    for leaf, path in zip(tree.leaves(), paths, strict=True):
        assert path[-1] == leaf.id and all(i in by_id for i in path)
        assert by_id[path[0]].parent_id is None
        assert sum(by_id[i].length for i in path) == len(tree.completion(leaf))
    parents = {r.parent_id for r in rows}
    assert {r.node_id for r in rows if r.node_id not in parents} == {
        leaf.id for leaf in tree.leaves()
    }


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("branching", 1),
        ("segment_tokens", 0),
        ("max_leaves", 0),
        ("max_tokens", 0),
        ("max_new_tokens", 0),
        ("eos_id", -1),
        ("branching", 2.5),
        ("max_leaves", True),
        ("uct_c", -0.1),
        ("uct_c", float("nan")),
        ("uct_c", float("inf")),
        ("uct_c", "1"),
        ("probe_leaves", -1),
        ("prefix_cache", 1),
        ("branch_entropy", -0.5),
        ("branch_entropy", float("inf")),
    ],
)
def test_config_errors_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(StageError, match=rf"^grpo\.tree\.{key}: expected"):
        _cfg(**{key: value})


def test_config_values_at_their_minimums_are_accepted() -> None:
    assert _cfg(max_tokens=1, max_new_tokens=1, probe_leaves=0, eos_id=0).max_tokens == 1
    assert _cfg(branching=8, max_leaves=8).branching == 8  # B may equal the group size


@pytest.mark.parametrize(("branching", "max_leaves"), [(3, 2), (2, 1)])
def test_more_branches_than_the_group_size_are_refused_naming_both(
    branching: int, max_leaves: int
) -> None:
    message = rf"^grpo\.tree\.branching: expected at most grpo\.group_size \({max_leaves}\), the leaves a tree is grown to, got {branching}$"
    with pytest.raises(StageError, match=message):
        _cfg(branching=branching, max_leaves=max_leaves)


def test_the_prefix_cache_switch_resumes_but_a_search_setting_retrains() -> None:
    """The checkpoint fingerprint leaves out grpo.tree.prefix_cache (same tokens, other speed)
    and keeps what changes the samples."""
    from stagetrain.grpo.train import fingerprinted

    grpo = {"steps": 3, "log_every": 1, "tree": {"branching": 2, "prefix_cache": True}}
    base = fingerprinted(grpo)
    assert fingerprinted({**grpo, "tree": {"branching": 2, "prefix_cache": False}}) == base
    assert fingerprinted({**grpo, "tree": {"branching": 4, "prefix_cache": True}}) != base
    assert fingerprinted({**grpo, "log_every": 5}) == base
