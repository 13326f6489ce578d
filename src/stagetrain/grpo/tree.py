"""The tree mode of the GRPO stage: one search tree per prompt whose nodes are partial completions.

Flat GRPO samples whole completions per prompt, and siblings that share a long prefix each pay
to generate it. The tree generates a prefix once and branches from it. The search is a UCT tree
sampler with verifier rewards at the leaves and no rollout simulation: it selects a node by UCT
(mean reward of the finished leaves under a child plus an exploration term), samples B
continuations of at most K tokens from it, scores the finished ones with the verifier and backs
the rewards up. Unfinished nodes get no value estimate until a leaf under them finishes. So it
scores more completions for the same generated tokens, and every node gets a value (the mean
reward of the finished leaves under it) for per-segment advantages.

`search_trees` grows the trees of many prompts together in rounds: each round selects one node
in every open tree and expands them all in one batched sampler call (as few calls as the
generation batch allows), so the sampler runs once per round rather than once per node.

The module knows no model: the caller passes `expand` (the sampler) and `score` (the verifier),
so the search is tested with fakes and is deterministic whenever the callbacks are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stagetrain.errors import StageError

Expand = Callable[[list[list[int]], int, int], list[list[int]]]
"""(prefixes, B, K) -> B continuations per prefix, flattened in prefix order, each 1..K tokens.

Prefixes are completion tokens only (the caller prepends the prompt). A continuation may end
with eos; tokens after the first eos (a sampler's padding) are dropped.
"""
Score = Callable[[list[int]], float]
"""The verifier's reward for one finished completion (its token ids, eos included if present)."""

ROOT = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeConfig:
    """The search's shape and budgets; a bad value is a config error naming `grpo.tree.<key>`."""

    branching: int
    """B: continuations sampled per expansion (>= 2, or the tree is a single flat completion)."""
    segment_tokens: int
    """K: the most tokens one continuation adds."""
    max_leaves: int
    """Stop once this many finished leaves exist."""
    max_tokens: int
    """Stop once this many tokens were generated (shared prefixes counted once)."""
    max_new_tokens: int
    """A completion's length limit: a node that reaches it is finished."""
    uct_c: float
    """The exploration constant c of UCT; 0 is greedy on the mean reward."""
    eos_id: int
    probe_leaves: int = 0
    """Stop a tree whose first `probe_leaves` finished leaves all got the same reward (0: never):
    such a group is likely to stay without reward variance, which the loss drops, so the
    tokens it would still spend carry no signal (DAPO's dynamic sampling, inside the budget)."""
    branch_entropy: float = 0.0
    """0: every continuation runs segment_tokens tokens. Above 0: the sampler ends a segment
    before its first token (after the first) sampled from a distribution of more entropy (nats)
    than this, so the tree branches where the policy is uncertain; segment_tokens stays the
    longest segment."""

    prefix_cache: bool = True
    """Keep each open node's KV cache between rounds (`grpo/prefix_cache.py`), so a round prefills
    only new tokens; off, every round prefills prompt and prefix again (for a model whose cache
    the prefix cache does not handle, and the benchmark's comparison)."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_cache, bool):
            raise StageError(
                f"grpo.tree.prefix_cache: expected true or false, got {self.prefix_cache!r}"
            )
        minimum = {"branching": 2, "segment_tokens": 1, "max_leaves": 1, "max_tokens": 1}
        minimum |= {"max_new_tokens": 1, "eos_id": 0, "probe_leaves": 0}
        for key, low in minimum.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise StageError(f"grpo.tree.{key}: expected an integer >= {low}, got {value!r}")
        if self.branching > self.max_leaves:
            raise StageError(
                f"grpo.tree.branching: expected at most grpo.group_size ({self.max_leaves}), the "
                f"leaves a tree is grown to, got {self.branching}"
            )
        for key in ("uct_c", "branch_entropy"):
            c = getattr(self, key)
            if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < math.inf:
                raise StageError(f"grpo.tree.{key}: expected a finite number >= 0, got {c!r}")


@dataclass(kw_only=True, slots=True)
class Node:
    """A partial completion: its parent's completion followed by this node's own tokens."""

    id: int
    parent: int | None
    """None for the root (the empty completion after the prompt)."""
    tokens: list[int]
    """This node's own segment, not the prefix (empty for the root)."""
    finished: bool = False
    """The segment ended with eos or the completion reached max_new_tokens: a leaf to score."""
    children: list[int] = field(default_factory=list)
    visits: int = 0
    """Finished leaves backed up through this node."""
    value_sum: float = 0.0

    @property
    def value(self) -> float:
        """Mean reward of the finished leaves under this node; 0.0 before any (visits says so)."""
        return self.value_sum / self.visits if self.visits else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeSegment:
    """One scored node below the root, as the advantage code reads it."""

    node_id: int
    parent_id: int | None
    """None for a child of the root (the prompt)."""
    value: float
    visits: int
    start: int
    """Offset of the segment's first token in the completion."""
    length: int


class SearchTree:
    """A prompt's tree: node ids are indices into `nodes`, in creation order; the root is 0."""

    def __init__(self, cfg: TreeConfig) -> None:
        self.cfg = cfg
        self.nodes: list[Node] = [Node(id=ROOT, parent=None, tokens=[])]
        self.generated_tokens = 0
        self._closed: set[int] = set()
        """Nodes with nothing left to expand under them: finished, or all children closed."""

    @property
    def root(self) -> Node:
        """The empty completion: the prompt alone."""
        return self.nodes[ROOT]

    def uct(self, parent: Node, child: Node) -> float:
        """value + c * sqrt(ln(parent visits) / child visits); inf for an unvisited child."""
        if child.visits == 0:
            return math.inf
        return child.value + self.cfg.uct_c * math.sqrt(math.log(parent.visits) / child.visits)

    def select(self) -> Node | None:
        """The next node to expand, or None when every path ends in a finished leaf.

        From the root, descend to the open child (one with something to expand under it) of
        highest UCT, ties and unvisited children going to the first created, and stop at the
        first node without children. Finished leaves are closed, so they are never selected.
        """
        node = self.root
        if node.id in self._closed:
            return None
        while node.children:
            node = self._best_child(node)
        return node

    def _best_child(self, node: Node) -> Node:
        open_children = [self.nodes[i] for i in node.children if i not in self._closed]
        return max(open_children, key=lambda child: self.uct(node, child))

    def segment_limit(self, node: Node) -> int:
        """The most tokens one continuation of `node` may add: K, or less near max_new_tokens."""
        return min(self.cfg.segment_tokens, self.cfg.max_new_tokens - len(self.completion(node)))

    def expand(self, node: Node, continuations: list[list[int]]) -> list[Node]:
        """Add one child per continuation (cut after its first eos) and count its tokens.

        The root may be expanded again once every path under it has finished (`closed`): it
        widens, so a prompt whose completions all end within a segment still gets its leaves.
        All continuations are checked before any is added, so a bad one leaves the tree as it was.
        """
        widening = node.id == ROOT and self.closed
        if node.finished or (node.children and not widening) or not continuations:
            raise ValueError(f"node {node.id}: finished or already expanded, or no continuations")
        limit, length = self.segment_limit(node), len(self.completion(node))
        cut = [self._cut(node, tokens, limit) for tokens in continuations]
        self._closed.discard(node.id)
        children = [self._add_child(node, tokens, length) for tokens in cut]
        self._close_up(node)
        return children

    @property
    def closed(self) -> bool:
        """Whether every path has ended in a finished leaf (`select` gives None)."""
        return ROOT in self._closed

    def _cut(self, node: Node, tokens: list[int], limit: int) -> list[int]:
        eos = self.cfg.eos_id
        tokens = tokens[: tokens.index(eos) + 1] if eos in tokens else list(tokens)
        if not 1 <= len(tokens) <= limit:
            raise ValueError(
                f"node {node.id}: a continuation must have 1..{limit} tokens, got {tokens}"
            )
        return tokens

    def _add_child(self, node: Node, tokens: list[int], length: int) -> Node:
        finished = tokens[-1] == self.cfg.eos_id or length + len(tokens) >= self.cfg.max_new_tokens
        child = Node(id=len(self.nodes), parent=node.id, tokens=tokens, finished=finished)
        self.nodes.append(child)
        node.children.append(child.id)
        self.generated_tokens += len(tokens)
        if finished:
            self._closed.add(child.id)
        return child

    def _parent(self, node: Node) -> Node | None:
        return None if node.parent is None else self.nodes[node.parent]

    def _close_up(self, node: Node | None) -> None:
        while node is not None and all(i in self._closed for i in node.children):
            self._closed.add(node.id)
            node = self._parent(node)

    def backup(self, leaf: Node, reward: float) -> None:
        """Add the reward and one visit to `leaf` and every ancestor up to the root."""
        node: Node | None = leaf
        while node is not None:
            node.visits += 1
            node.value_sum += reward
            node = self._parent(node)

    def path(self, node: Node) -> list[int]:
        """Node ids from the root's child down to `node` (empty for the root)."""
        ids: list[int] = []
        while node.parent is not None:
            ids.append(node.id)
            node = self.nodes[node.parent]
        return ids[::-1]

    def completion(self, node: Node) -> list[int]:
        """The tokens from the root down to `node`, concatenated."""
        return [token for i in self.path(node) for token in self.nodes[i].tokens]

    def leaves(self) -> list[Node]:
        """The finished leaves, in creation order."""
        return [node for node in self.nodes if node.finished]


@dataclass(frozen=True, slots=True)
class Request:
    """One selected node of one tree, to be expanded in a batched `generate` call."""

    tree: int
    """The tree's index in the list `search_trees` grows (the caller's prompt index)."""
    prefix: list[int]
    """The node's completion: tokens after the prompt, root to node."""
    limit: int
    """The most tokens a continuation of this node may add (`SearchTree.segment_limit`)."""


BatchExpand = Callable[[list[Request], int, int], list[list[int]]]
"""(requests, B, K) -> B continuations per request, flattened in request order.

K is the largest `limit` of the requests (one sampler call has one length); the search cuts
each continuation to its own request's limit and after its first eos.
"""
TreeScore = Callable[[int, list[int]], float]
"""The verifier's reward for one finished completion of the tree with the given index."""


def _spent(tree: SearchTree) -> bool:
    """Whether the tree's leaf or token budget is used up, or its probe found no variance."""
    leaves = tree.leaves()
    if len(leaves) >= tree.cfg.max_leaves or tree.generated_tokens >= tree.cfg.max_tokens:
        return True
    probe = tree.cfg.probe_leaves
    return probe > 0 and len(leaves) >= probe and len({leaf.value for leaf in leaves}) == 1


def search_trees(
    cfgs: Sequence[TreeConfig], expand: BatchExpand, score: TreeScore, max_batch: int
) -> list[SearchTree]:
    """Grow one tree per config together, in rounds, until each spends its leaf or token budget.

    A round selects one node (UCT) in every tree within budget (the root again in a tree whose
    paths have all finished: it widens), expands all of
    them with as few `expand` calls as `max_batch` allows (at most max_batch // B nodes, so
    at most max_batch sequences, per call, in tree order), scores each finished child and backs
    its reward up. A tree's budgets are checked before each round, so its last expansion may
    overshoot by up to B - 1 leaves and B * K tokens. Nothing is random here: the same
    callbacks give the same trees, and one tree grows exactly as it would alone.
    """
    if len({cfg.branching for cfg in cfgs}) > 1:
        raise ValueError("search_trees: every tree must have the same branching")
    trees = [SearchTree(cfg) for cfg in cfgs]
    while chosen := _select_round(trees):
        per_call = max(1, max_batch // trees[0].cfg.branching)
        for at in range(0, len(chosen), per_call):
            _expand_batch(trees, chosen[at : at + per_call], expand, score)
    return trees


def _select_round(trees: Sequence[SearchTree]) -> list[tuple[int, Node]]:
    """(tree index, node to expand) of every tree within budget: the UCT selection, or the
    root when every path has finished (it widens: B more children of the prompt). Without
    widening, a prompt whose answers all end in the first segment would get B leaves, not a
    group: on the level-1 prompts of the tiny model (2-3 token answers) every tree did."""
    return [(i, tree.select() or tree.root) for i, tree in enumerate(trees) if not _spent(tree)]


def _expand_batch(
    trees: Sequence[SearchTree],
    chosen: Sequence[tuple[int, Node]],
    expand: BatchExpand,
    score: TreeScore,
) -> None:
    """One `expand` call for the chosen nodes; their children added, scored and backed up."""
    requests = [
        Request(tree=i, prefix=trees[i].completion(node), limit=trees[i].segment_limit(node))
        for i, node in chosen
    ]
    b = trees[0].cfg.branching
    continuations = expand(requests, b, max(r.limit for r in requests))
    if len(continuations) != b * len(requests):
        raise ValueError(
            f"expand returned {len(continuations)} continuations, expected {b * len(requests)}"
        )
    for j, (request, (i, node)) in enumerate(zip(requests, chosen, strict=True)):
        tree, eos = trees[i], trees[i].cfg.eos_id
        mine = [through_eos(c, eos)[: request.limit] for c in continuations[j * b : (j + 1) * b]]
        for child in tree.expand(node, mine):
            if child.finished:
                tree.backup(child, float(score(i, tree.completion(child))))


def through_eos(tokens: list[int], eos: int) -> list[int]:
    """The tokens up to and including the first eos."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def search(cfg: TreeConfig, expand: Expand, score: Score) -> SearchTree:
    """Grow a single prompt's tree: `search_trees` with one tree and one node per `expand` call.

    Each iteration selects one node, calls `expand` once with its completion (one prefix, B,
    `segment_limit`), scores each finished child and backs its reward up.
    """

    def batch(requests: list[Request], b: int, k: int) -> list[list[int]]:
        return expand([r.prefix for r in requests], b, k)

    return search_trees([cfg], batch, lambda _, completion: score(completion), max_batch=1)[0]


def flat_equivalent_tokens(tree: SearchTree) -> int:
    """Tokens a flat sampler would generate for the same finished leaves: their full lengths."""
    return sum(len(tree.completion(leaf)) for leaf in tree.leaves())


def segments(tree: SearchTree) -> tuple[list[TreeSegment], list[list[int]]]:
    """The scored nodes below the root, and each finished leaf's path of node ids.

    Only nodes with a finished leaf under them (visits > 0) are exported: the others have no
    value, no trained completion contains their tokens, and to the advantage code a childless
    segment is a leaf. So every exported segment without exported children is a finished leaf.
    Segments are in creation order (parents first); paths follow `leaves()`, root child first.
    """
    rows = [
        TreeSegment(
            node_id=node.id,
            parent_id=None if node.parent == ROOT else node.parent,
            value=node.value,
            visits=node.visits,
            start=len(tree.completion(node)) - len(node.tokens),
            length=len(node.tokens),
        )
        for node in tree.nodes[1:]
        if node.visits > 0
    ]
    return rows, [tree.path(leaf) for leaf in tree.leaves()]
