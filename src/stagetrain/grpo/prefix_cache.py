"""Prefix KV caches between the tree's rounds, so that a round prefills only what is new.

Without them every round of `tree.search_trees` hands `generate` the prompt and the whole
prefix of each selected node, and the model recomputes their keys and values: on levels 2-3
of the curriculum that was 5.5x the positions flat sampling prefills. A node's keys and values
were already computed in the round that sampled it, so `PrefixCache.sample` keeps, for each
continuation the caller will expand later, the cache of its sequence (prompt, prefix and the
continuation, all but the last token), keyed by those tokens. The next round looks the
sequence up, left-pads the cached rows into one `DynamicCache` and passes it to `generate`
with the full input ids and attention mask, so `generate` feeds only the last token.

Generation is unchanged: the same `generate` call, logits processors and sampling; the keys
and values are those the model computed for the same tokens at the same positions (position
ids come from the attention mask, as in an uncached call), so outputs differ from an
uncached call by float rounding at most. Misses (a prompt's first round, a root that widens, a
node two siblings share) are prefilled in one forward pass per call.

Flat rollouts sample through it too (`rollouts.sample`, keeping nothing): each prompt is then
prefilled once and its cache repeated to its group's rows, where `generate` alone would
prefill every row's copy of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from stagetrain.grpo.sampling import Sampled, cache_argument, generate, left_padded
from stagetrain.training.experts import Routing

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, keys and values of one sequence: [kv_heads, length, head_dim] each."""


class PrefixCache:
    """Caches of sequences the caller will extend, each used once (then dropped).

    One instance serves one rollout (`rollouts.tree_groups`): its entries are the open
    nodes' caches, so it holds about (open nodes) x (their length) positions per layer; or one
    flat `generate` call (`rollouts.sample`), which keeps none.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._store: dict[tuple[int, ...], KV] = {}

    def sample(
        self,
        sequences: Sequence[list[int]],
        n: int,
        max_new_tokens: int,
        keep: Sequence[int],
        generation: dict,
        branch_entropy: float = 0.0,
        seeds: Sequence[int] = (),
        routing: Routing | None = None,
    ) -> Sampled:
        """n continuations of each sequence in one `generate` call (`sampling.generate`, which
        records an MoE policy's `routing`), and the cache of each sequence plus its first
        `keep[i]` continuation tokens kept for later (none for a continuation that ends with
        eos: it will not be extended)."""
        width = max(len(s) for s in sequences)
        cached = self._lookup(sequences)
        layers = [
            self._batch([kv[layer] for kv in cached], width - 1, n)
            for layer in range(len(cached[0]))
        ]
        cache = DynamicCache(ddp_cache_data=layers)
        sampled = generate(
            self.model,
            sequences,
            n,
            max_new_tokens,
            generation,
            branch_entropy=branch_entropy,
            cache=cache,
            seeds=seeds,
            routing=routing,
        )
        for j, row in enumerate(sampled.tokens):
            sequence, kept = sequences[j // n], row[: keep[j // n]]
            if kept and kept[-1] != generation["eos_token_id"]:
                self._keep(sequence + kept, cache, j, width - len(sequence))
        return sampled

    def _lookup(self, sequences: Sequence[list[int]]) -> list[KV]:
        """Each sequence's cache (all its tokens but the last): from the store, or prefilled."""
        found = [self._store.pop(tuple(s), None) for s in sequences]
        missing = [i for i, kv in enumerate(found) if kv is None]
        if missing:
            for i, kv in zip(missing, self._prefill([sequences[i] for i in missing]), strict=True):
                found[i] = kv
        return found  # type: ignore[return-value]

    def _prefill(self, sequences: list[list[int]]) -> list[KV]:
        """One forward pass over the sequences (left-padded, positions from the mask, as
        `generate` makes them); each row's cache cut to its tokens but the last."""
        device = next(self.model.parameters()).device
        ids, mask, position = left_padded(sequences, 0, device)
        width = ids.shape[1]
        cache = DynamicCache()
        self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True,
                   **{cache_argument(self.model): cache})  # fmt: skip
        return [
            [(layer.keys[j, :, width - len(s) : width - 1].clone(), layer.values[j, :, width - len(s) : width - 1].clone())
             for layer in cache.layers]
            for j, s in enumerate(sequences)
        ]  # fmt: skip

    @staticmethod
    def _batch(
        rows: list[tuple[torch.Tensor, torch.Tensor]], length: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of the rows, left-padded with zeros to `length`
        (the attention mask hides them) and each row repeated n times."""
        keys, values = rows[0]  # DeepSeek's attention (MLA) keeps values narrower than keys
        k = keys.new_zeros((len(rows), keys.shape[0], length, keys.shape[-1]))
        v = values.new_zeros((len(rows), values.shape[0], length, values.shape[-1]))
        for j, (key, value) in enumerate(rows):
            if key.shape[1]:
                k[j, :, length - key.shape[1] :] = key
                v[j, :, length - value.shape[1] :] = value
        return k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)

    def _keep(self, sequence: list[int], cache: DynamicCache, row: int, pad: int) -> None:
        """Store row `row`'s cache of `sequence` (its tokens but the last), which starts after
        `pad` positions of left padding."""
        end = pad + len(sequence) - 1
        self._store[tuple(sequence)] = [
            (layer.keys[row, :, pad:end].clone(), layer.values[row, :, pad:end].clone())
            for layer in cache.layers
        ]
