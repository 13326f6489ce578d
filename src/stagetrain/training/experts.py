"""Mixture-of-experts in training: the router's load-balancing loss, and how evenly experts load.

A router trained on the language-model loss alone can collapse onto a few experts, the rest
idle, and nothing in that loss shows it. transformers defines each MoE family's auxiliary loss
(Switch Transformer's `num_experts * sum_e f_e * P_e`, `load_balancing_loss_func`) and returns
it with the router logits when a forward asks for them (`output_router_logits`); pretraining
adds `router_aux_loss_coef` times it to the cross-entropy (the architecture's coefficient, or
`model.router_aux_loss_coef`), logs it apart, and measures from the same logits which share of
the routed tokens each expert got. The validation loss and consolidation's check stay the
language-model loss alone (`training.evaluation`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from stagetrain.training.evaluation import forward_loss


class Routing(NamedTuple):
    """How a model routes: experts per MoE layer, experts per token, the aux loss's weight."""

    experts: int
    top_k: int
    coef: float


def routing_of(config: Any) -> Routing | None:
    """The routing of a transformers config; None for a dense model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts or not hasattr(config, "router_aux_loss_coef"):
        return None
    return Routing(
        int(experts), int(config.num_experts_per_tok), float(config.router_aux_loss_coef)
    )


def expert_shares(router_logits: Sequence[torch.Tensor], top_k: int, experts: int) -> torch.Tensor:
    """(MoE layers, experts): each expert's share of the layer's top-k assignments."""
    rows = []
    for logits in router_logits:
        chosen = logits.detach().float().topk(top_k, dim=-1).indices.reshape(-1)
        rows.append(torch.bincount(chosen, minlength=experts).float() / chosen.numel())
    return torch.stack(rows)


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
    (unweighted) and the expert load."""

    aux_loss: float
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


def training_loss(
    model: Any,
    device: torch.device,
    shard: np.ndarray,
    windows: np.ndarray,
    seq_len: int,
    routing: Routing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss to train on, language-model loss, aux loss, expert shares) of an MoE `model` on
    `windows`: the cross-entropy of `evaluation.window_loss`, plus `routing.coef`
    times the router's load-balancing loss."""
    lm, out = forward_loss(model, device, shard, windows, seq_len, output_router_logits=True)
    aux = out.aux_loss.float()
    shares = expert_shares(out.router_logits, routing.top_k, routing.experts)
    return lm + routing.coef * aux, lm, aux, shares
