"""Mixture-of-experts in training: how the router is balanced, and how evenly experts load.

A router trained on the language-model loss alone can collapse onto a few experts, the rest
idle, and nothing in that loss shows it. Two remedies, each as its architecture defines it:

- mixtral, qwen2_moe: transformers defines each family's auxiliary loss (Switch Transformer's
  `num_experts * sum_e f_e * P_e`, `load_balancing_loss_func`) and returns it with the router
  logits when a forward asks for them (`output_router_logits`); pretraining adds
  `router_aux_loss_coef` times it to the cross-entropy (the architecture's coefficient, or
  `model.router_aux_loss_coef`) and logs it apart.
- deepseek_v3: transformers defines no aux loss. Its router chooses each token's experts by
  the sigmoid of its logits plus a per-expert bias (`e_score_correction_bias`, a buffer; the
  gate weights of the chosen experts use the scores without it), and DeepSeek-V3's
  auxiliary-loss-free balancing trains that bias outside the gradient: after each optimizer
  step, every expert's bias moves by `router_bias_update_rate` up if the expert got fewer
  tokens than the layer's mean, down if more (`bias_update`), the tokens counted over every
  rank so that every rank's bias stays the same (`balance_routers`).

Either way the same step measures which share of the routed tokens each expert got
(`expert_counts`: the experts the router actually chose, bias included). The validation
loss and consolidation's check stay the language-model loss alone (`training.evaluation`).

Under expert parallelism DeepSpeed's AutoEP replaces each MoE block with its own layer, whose
router (`TokenChoiceTopKRouter`) returns no logits to transformers' output: the counts are
then that router's own choices, read by a forward hook (`autoep_choices`), and the bias
update moves that router's copy of the bias, found by the same name.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from stagetrain.errors import StageError
from stagetrain.model.architectures import BIAS_BALANCED, ROUTER_BIAS_UPDATE_RATE
from stagetrain.training import autoep
from stagetrain.training.evaluation import forward_loss

BIAS = "e_score_correction_bias"
"""The routing bias's buffer in transformers' DeepseekV3 router (`DeepseekV3TopkRouter`)."""


class Routing(NamedTuple):
    """How a model routes: experts per MoE layer, experts per token, and how it is balanced: the
    aux loss's weight (`coef`; None where the architecture defines no aux loss) or the routing
    bias's step (`bias_rate`; None where the router has no bias), and the expert groups a
    biased router first chooses among (`groups` of them, the best `top_groups` kept)."""

    experts: int
    top_k: int
    coef: float | None
    bias_rate: float | None = None
    groups: int = 1
    top_groups: int = 1


def routing_of(config: Any) -> Routing | None:
    """The routing of a transformers config; None for a dense model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return None
    top_k = int(config.num_experts_per_tok)
    if hasattr(config, "router_aux_loss_coef"):
        return Routing(int(experts), top_k, float(config.router_aux_loss_coef))
    if config.model_type not in BIAS_BALANCED:
        return None
    rate = getattr(config, "router_bias_update_rate", ROUTER_BIAS_UPDATE_RATE)
    return Routing(int(experts), top_k, None, float(rate), int(config.n_group or 1),
                   int(config.topk_group or 1))  # fmt: skip


def chosen_experts(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    groups: int = 1,
    top_groups: int = 1,
) -> torch.Tensor:
    """(tokens, top_k): the experts a router chose for each token from its `logits` (tokens,
    experts). Without a bias, the largest logits (softmax routers: the order is the
    probabilities'). With one, DeepSeek-V3's choice as transformers' `DeepseekV3TopkRouter`
    makes it: sigmoid(logits) + bias, within the `top_groups` expert groups whose two best
    such scores sum highest (all of them when `groups` is 1)."""
    scores = logits.detach().float()
    if bias is None:
        return scores.topk(top_k, dim=-1).indices
    choice = scores.sigmoid() + bias.detach().float()
    if groups > 1:
        by_group = choice.view(len(choice), groups, -1)
        best = by_group.topk(2, dim=-1).values.sum(-1).topk(top_groups, dim=-1).indices
        keep = torch.zeros(len(choice), groups, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(by_group.shape[-1], dim=1), -math.inf)
    return choice.topk(top_k, dim=-1).indices


def expert_counts(
    router_logits: Sequence[torch.Tensor],
    routing: Routing,
    biases: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(MoE layers, experts), int64: how many tokens each layer's router sent to each expert
    (`chosen_experts`; `biases`, one per layer in the logits' order, for a biased router)."""
    rows = []
    for i, logits in enumerate(router_logits):
        bias = biases[i] if biases is not None else None
        chosen = chosen_experts(logits, routing.top_k, bias, routing.groups, routing.top_groups)
        rows.append(torch.bincount(chosen.reshape(-1), minlength=routing.experts))
    return torch.stack(rows)


def chosen_by_position(
    router_logits: Sequence[torch.Tensor],
    rows: int,
    routing: Routing,
    biases: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(rows, positions, MoE layers, top_k): the experts each position of a forward's `rows`
    sequences chose in each layer (`chosen_experts`), from the router logits transformers
    returns, one (rows x positions, experts) tensor per MoE layer."""
    layers = []
    for i, logits in enumerate(router_logits):
        bias = biases[i] if biases is not None else None
        chosen = chosen_experts(logits, routing.top_k, bias, routing.groups, routing.top_groups)
        layers.append(chosen.view(rows, -1, routing.top_k))
    return torch.stack(layers, 2)


def routed_by_position(chosen: Sequence[torch.Tensor], rows: int, top_k: int) -> torch.Tensor:
    """(rows, positions, MoE layers, top_k) as `chosen_by_position` makes it, from what AutoEP's
    routers chose (`autoep_choices`: one (rows x positions, top_k) per MoE layer), which their
    logits, not returned, would give."""
    return torch.stack([c.view(rows, -1, top_k) for c in chosen], 2)


def routing_flips(first: torch.Tensor, second: torch.Tensor) -> int:
    """How many (token, MoE layer) pairs chose a different set of experts in two routings of the
    same tokens, each (..., layers, top_k): the order within a token's top-k does not count."""
    return int((first.sort(-1).values != second.sort(-1).values).any(-1).sum())


def expert_shares(counts: torch.Tensor) -> np.ndarray:
    """(MoE layers, experts): each expert's share of its layer's routed tokens."""
    counts = counts.double().cpu()
    return (counts / counts.sum(dim=1, keepdim=True)).numpy()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step: each expert's routing bias (layers,
    experts) plus `rate` times the sign of (the layer's mean load - the expert's load), where
    `load` counts the tokens routed to each expert (layers, experts). An expert below the mean
    gains, one above loses, one at the mean stays; the sign is taken on whole counts
    (experts x load against the layer's total), so a tie is exact on every rank."""
    experts = load.shape[-1]
    direction = torch.sign(load.sum(dim=-1, keepdim=True) - experts * load)
    return bias + rate * direction.to(bias.dtype)


def router_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    """The routing biases of `model`'s MoE layers, in layer order (the router logits' order),
    each checked to be fp32: a 16-bit bias would round a 0.001 step away (DeepSpeed keeps it
    in fp32 because transformers' `_keep_in_fp32_modules_strict` names it).

    Raises:
        StageError: a bias that is not fp32.
    """
    found = []
    for name, module in model.named_modules():
        bias = getattr(module, BIAS, None)
        if isinstance(bias, torch.Tensor):
            if bias.dtype != torch.float32:
                raise StageError(
                    f"model.router_bias_update_rate: {name}.{BIAS} is {bias.dtype}, not fp32: its "
                    "updates would be rounded away (is DeepSpeed's data_types.keep_in_fp32_modules off?)"
                )
            found.append(bias)
    return found


def balance_routers(model: torch.nn.Module, load: torch.Tensor, rate: float) -> None:
    """Apply `bias_update` to every MoE layer's routing bias, in place, from `load` (MoE layers,
    experts): the step's tokens per expert, summed over every rank, so that every rank makes
    the same update (buffers are never ZeRO-partitioned: each rank holds the whole bias)."""
    biases = router_biases(model)
    if len(biases) != len(load):
        raise StageError(
            f"model.router_bias_update_rate: {len(biases)} routing biases, but loads of {len(load)} MoE layers"
        )
    with torch.no_grad():
        for bias, row in zip(biases, load, strict=True):
            bias.copy_(bias_update(bias, row.to(bias.device), rate))


LoadStats = TypedDict(
    "LoadStats",
    {
        "moe/load_entropy": float,
        "moe/load_max_over_mean": float,
        "moe/load_entropy_by_layer": dict[str, float],
        "moe/load_max_over_mean_by_layer": dict[str, float],
        "moe/load_by_layer": list[list[float]],
    },
)
"""`load_stats`: the expert-load metrics of a step (pretrain's registry says what each means)."""


class RoutingStep(NamedTuple):
    """An MoE model's routing over one training step, all ranks: the mean load-balancing loss
    (unweighted; None where the architecture defines none) and the expert load."""

    aux_loss: float | None
    load: LoadStats


def load_stats(shares: np.ndarray) -> LoadStats:
    """What the metrics log of a step's expert shares (layers x experts): per layer and averaged,
    the entropy of the shares over log(experts) (1.0: every expert equally loaded; 0: one takes
    everything) and the largest share over the mean share (1.0 balanced; `experts` collapsed)."""
    experts = shares.shape[1]
    safe = np.where(shares > 0, shares, 1.0)
    entropy = -(shares * np.log(safe)).sum(axis=1) / math.log(experts)
    peak = shares.max(axis=1) * experts
    return {
        "moe/load_entropy": float(entropy.mean()),
        "moe/load_max_over_mean": float(peak.mean()),
        "moe/load_entropy_by_layer": {str(i): float(v) for i, v in enumerate(entropy)},
        "moe/load_max_over_mean_by_layer": {str(i): float(v) for i, v in enumerate(peak)},
        "moe/load_by_layer": [[round(float(v), 5) for v in row] for row in shares],
    }


@contextlib.contextmanager
def autoep_choices(model: Any) -> Iterator[list[torch.Tensor]]:
    """While open, the experts each AutoEP router chooses, (tokens, top_k) per MoE layer in
    forward order; an empty list for a model AutoEP did not replace. Closed before the
    backward pass, so a recomputed forward (activation checkpointing) is not counted twice."""
    chosen: list[torch.Tensor] = []
    handles = [
        router.register_forward_hook(
            lambda _m, _args, out: chosen.append(out[autoep.CHOSEN].detach())
        )
        for router in autoep.routers(model)
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def training_loss(
    model: Any,
    device: torch.device,
    shard: np.ndarray,
    windows: np.ndarray,
    seq_len: int,
    routing: Routing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(loss to train on, language-model loss, aux loss, expert counts) of an MoE `model` on
    `windows`: the cross-entropy of `evaluation.window_loss`, plus `routing.coef` times the
    router's load-balancing loss where the architecture defines one (else the aux loss is
    None and the loss is the cross-entropy); the counts as `expert_counts` makes them, with
    the routing biases the forward used."""
    with autoep_choices(model) as chosen:
        lm, out = forward_loss(model, device, shard, windows, seq_len, output_router_logits=True)
    if chosen:
        counts = torch.stack(
            [torch.bincount(c.reshape(-1), minlength=routing.experts) for c in chosen]
        )
    else:
        biases = router_biases(model) if routing.bias_rate is not None else None
        counts = expert_counts(out.router_logits, routing, biases)
    if routing.coef is None:
        return lm, lm, None, counts
    aux = out.aux_loss.float()
    return lm + routing.coef * aux, lm, aux, counts
