"""The clipped GRPO objective, its KL penalty, and the three ways to average it over tokens.

Per completion token t of sequence i, with A the advantage (per sequence or per token):

    ratio = exp(logp - logp_old)
    pg    = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    k3    = exp(logp_ref - logp) - (logp_ref - logp) - 1      (>= 0; Schulman's k3 estimator of KL(pi || ref))
    loss_t = w * pg + beta * k3                               (no k3 term when beta == 0)

w is 1, or the caller's per-token weights (the truncated importance ratio of the sampler
correction, `grpo.steps.truncated_importance`), constants like the old log-probs.

The aggregations differ only in how tokens are weighted (M = the completion mask):

- "grpo" (DeepSeekMath, Shao et al. 2024): mean over each sequence's tokens, then
  mean over sequences, so a token of a short completion weighs more.
- "dapo" (DAPO, Yu et al. 2025): sum over all tokens of the batch / sum(M), every
  token weighs the same.
- "dr_grpo" (Dr. GRPO, Liu et al. 2025): sum over all tokens / (B * max_length), a
  constant normaliser, so the weight depends on neither the lengths nor the batch.

Old and reference log-probs are constants (detached); only `logprobs` gets a
gradient. Positions outside the mask are zeroed before exp, so padding that
holds garbage (even inf) cannot turn the loss or its gradient into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from stagetrain.errors import StageError

LossType = Literal["grpo", "dapo", "dr_grpo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossStats:
    """What one loss call logs; shares are over the completion tokens of the batch."""

    clip_ratio_low: float
    """Share of tokens with ratio < 1 - eps_low and A < 0 (the low clip is active)."""
    clip_ratio_high: float
    """Share of tokens with ratio > 1 + eps_high and A > 0 (the high clip is active)."""
    kl_mean: float | None
    """Mean k3 over the tokens; None when beta == 0 (no reference model)."""
    tokens: int
    """Completion tokens in the batch."""


def _check_settings(
    eps_low: float, eps_high: float, beta: float, loss_type: str, max_length: int | None
) -> None:
    if loss_type not in get_args(LossType):
        raise StageError(
            f"grpo.loss_type: must be one of {', '.join(get_args(LossType))} (got {loss_type!r})"
        )
    if not 0 <= eps_low < 1:
        raise StageError(f"grpo.clip_eps_low: must be in [0, 1) (got {eps_low})")
    if eps_high < 0:
        raise StageError(f"grpo.clip_eps_high: must be >= 0 (got {eps_high})")
    if beta < 0:
        raise StageError(f"grpo.kl_coef: must be >= 0 (got {beta})")
    if max_length is not None and max_length < 1:
        raise StageError(f"grpo.max_new_tokens: must be >= 1 (got {max_length})")


def _check_shapes(
    logprobs: torch.Tensor, advantages: torch.Tensor, **others: torch.Tensor | None
) -> None:
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be shaped (B, T), got {tuple(shape)}")
    for name, t in others.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shaped {tuple(t.shape)}, logprobs {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages shaped {tuple(advantages.shape)}: want (B,) or (B, T) with (B, T) = {tuple(shape)}"
        )


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_length: int
) -> torch.Tensor:
    """Reduce masked per-token losses (zero outside the mask) to the scalar loss."""
    if loss_type == "grpo":
        counts = mask.sum(dim=1)
        per_seq = per_token.sum(dim=1) / counts.clamp(min=1)
        return per_seq.sum() / (counts > 0).sum().clamp(min=1)
    if loss_type == "dapo":
        return per_token.sum() / mask.sum().clamp(min=1)
    return per_token.sum() / (per_token.shape[0] * max_length)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    beta: float,
    loss_type: LossType,
    max_length: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The scalar GRPO loss of a batch and its stats (formulas in the module docstring).

    logprobs, old_logprobs, ref_logprobs, mask: (B, T), mask 1 on completion tokens.
    advantages: (B,) broadcast over each sequence's tokens, or (B, T).
    max_length: Dr. GRPO's normaliser (the generation budget); defaults to T.
    token_weights: (B, T) weights of each token's policy-gradient term (detached), or None.
    Sequences without tokens add nothing; "grpo" averages over the sequences
    that have tokens, so masking a sequence out equals dropping it. An empty
    batch gives a zero loss that still backpropagates.
    """
    _check_settings(eps_low, eps_high, beta, loss_type, max_length)
    if beta > 0 and ref_logprobs is None:
        raise StageError(f"grpo.kl_coef: {beta} > 0 needs the reference model's log-probs")
    ref = ref_logprobs if beta > 0 else None
    _check_shapes(logprobs, advantages, old_logprobs=old_logprobs, ref_logprobs=ref, mask=mask,
                  token_weights=token_weights)  # fmt: skip
    keep = mask.bool()
    m = keep.to(logprobs.dtype)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    zero = torch.zeros_like(logprobs)
    adv = torch.where(keep, adv.to(logprobs.dtype), zero)
    ratio = torch.exp(torch.where(keep, logprobs - old_logprobs.detach(), zero))
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if token_weights is not None:
        per_token = per_token * torch.where(keep, token_weights.detach().to(per_token.dtype), zero)
    kl = None
    if ref is not None:
        delta = torch.where(keep, ref.detach() - logprobs, zero)
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    per_token = torch.where(keep, per_token, zero)
    loss = _aggregate(per_token, m, loss_type, max_length or logprobs.shape[1])

    with torch.no_grad():
        tokens = int(keep.sum())
        denom = max(tokens, 1)
        low = ((ratio < 1 - eps_low) & (adv < 0) & keep).sum().item() / denom
        high = ((ratio > 1 + eps_high) & (adv > 0) & keep).sum().item() / denom
        kl_mean = None if kl is None else float((kl * m).sum()) / denom
    return loss, LossStats(clip_ratio_low=low, clip_ratio_high=high, kl_mean=kl_mean, tokens=tokens)
