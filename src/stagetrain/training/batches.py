"""Which training samples each rank reads at each step: a pure function of (seed, step, rank).

The train shard is cut into non-overlapping windows of seq_len + 1 tokens (a
window gives the inputs and, shifted by one, the labels). The order of windows
is an endless stream of seeded permutations, one per epoch; optimizer step s
takes stream items [s * G, (s + 1) * G) for a global batch of G windows, and
data-parallel rank r takes its contiguous 1/dp of them, in micro batches.
So every window is used exactly once per epoch across all ranks, ranks never
overlap, ranks of one tensor-parallel group (same dp rank) read the same batch,
and the data position after a restart is just the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampler:
    """The data order of one training run."""

    windows: int
    """Number of windows in the train shard."""
    global_batch: int
    dp: int
    micro_batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.windows < self.global_batch:
            raise ValueError(
                f"the train shard holds {self.windows} windows, fewer than one global batch of "
                f"{self.global_batch}: add data (data.train_tokens) or shrink the batch"
            )

    def _epoch(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows)

    def step_windows(self, step: int) -> np.ndarray:
        """The global batch of `step` (0-based): window indices, for all ranks in rank order."""
        start = step * self.global_batch
        first, offset = divmod(start, self.windows)
        taken = self._epoch(first)[offset : offset + self.global_batch]
        epoch = first
        while len(taken) < self.global_batch:
            epoch += 1
            taken = np.concatenate([taken, self._epoch(epoch)[: self.global_batch - len(taken)]])
        return taken

    def rank_micro_batches(self, step: int, dp_rank: int) -> list[np.ndarray]:
        """Window indices of rank `dp_rank` at `step`, split into micro batches."""
        per_rank = self.global_batch // self.dp
        mine = self.step_windows(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return [
            mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)
        ]


def read_windows(shard: np.ndarray, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """The token windows (len(indices) x (seq_len + 1)) at `indices`, as int64."""
    starts = indices.astype(np.int64) * seq_len
    return np.stack([shard[s : s + seq_len + 1] for s in starts]).astype(np.int64)


def window_count(tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens, stepping by seq_len, that fit in `tokens` tokens."""
    return max(0, (tokens - 1) // seq_len)
