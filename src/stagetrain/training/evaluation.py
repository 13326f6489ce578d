"""Evaluation shared by the stages: the validation loss on token windows, and greedy task scores.

One validation loss for everyone: pretrain and GRPO log it on their fixed
validation windows, and consolidation recomputes it with the reloaded model on
the same windows (recorded in the summary's `eval_batch`) to prove the written
folder holds the trained weights. The three must compute the same thing the
same way (fp32 logits, the mean over micro batches of each micro batch's mean
token loss), or consolidation's tolerance would be measuring the difference
between two formulas instead of two copies of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stagetrain.tasks import Problem
from stagetrain.tasks.judge import Judge
from stagetrain.training import autoep
from stagetrain.training.batches import read_windows


def window_loss(
    model: Any, device: torch.device, shard: np.ndarray, windows: np.ndarray, seq_len: int
) -> torch.Tensor:
    """Mean next-token cross-entropy of `model` on `windows` of `shard` (fp32 logits).

    `model` is a DeepSpeed engine or a plain module: anything called with
    `input_ids` that returns `.logits`. The result keeps its graph (training uses it).
    """
    return forward_loss(model, device, shard, windows, seq_len)[0]


def forward_loss(
    model: Any,
    device: torch.device,
    shard: np.ndarray,
    windows: np.ndarray,
    seq_len: int,
    **forward: Any,
) -> tuple[torch.Tensor, Any]:
    """`window_loss` and the model's output of its forward, called with `forward` too (an MoE
    model's router logits: `training.experts`), so every stage's loss is this one formula."""
    tokens = torch.from_numpy(read_windows(shard, windows, seq_len)).to(device)
    out = model(input_ids=tokens[:, :-1], **forward)
    logits = out.logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return loss, out


def validation_loss(
    model: Any,
    shard: np.ndarray,
    windows: np.ndarray,
    *,
    seq_len: int,
    micro_batch_size: int,
    device: torch.device | None = None,
) -> float:
    """The validation loss: the mean over micro batches of `window_loss`, without gradients.

    The caller puts the model in eval mode (an engine goes back to train mode
    after). Every rank of a stage computes it alike, so it is the same on all.
    """
    device = device if device is not None else torch.device("cpu")
    with torch.no_grad():
        losses = [
            window_loss(model, device, shard, windows[i : i + micro_batch_size], seq_len).item()
            for i in range(0, len(windows), micro_batch_size)
        ]
    return float(np.mean(losses))


def greedy_completions(
    model: Any,
    judge: Judge,
    batch: Sequence[Problem],
    *,
    max_new_tokens: int,
    chunk_size: int,
) -> list[list[int]]:
    """Each problem's greedy completion (KV cache), its token ids as generated (the judge cuts
    them at the first stop); `chunk_size` problems per `generate` call."""
    out: list[list[int]] = []
    tokenizer = judge.prompter.tokenizer
    for start in range(0, len(batch), chunk_size):
        chunk = batch[start : start + chunk_size]
        ids = [judge.prompt_ids(p) for p in chunk]
        width = max(map(len, ids))
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        device = next(model.parameters()).device
        tokens = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        gen = model.generate(input_ids=tokens, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, use_cache=True, synced_gpus=in_lockstep(model))  # fmt: skip
        out.extend(gen[:, width:].tolist())
    return out


def greedy_scores(
    model: Any,
    judge: Judge,
    batch: Sequence[Problem],
    *,
    max_new_tokens: int,
    chunk_size: int,
) -> list[float]:
    """1.0 for each problem whose greedy completion solves it (`Judge.solved` on its family's
    weighted reward), else 0.0."""
    completions = greedy_completions(
        model, judge, batch, max_new_tokens=max_new_tokens, chunk_size=chunk_size
    )
    out: list[float] = []
    for start in range(0, len(batch), chunk_size):  # one reward call per chunk, as generated
        chunk = batch[start : start + chunk_size]
        rewards = judge.rewards(chunk, completions[start : start + chunk_size])
        out.extend(float(judge.solved(p, r)) for p, r in zip(chunk, rewards, strict=True))
    return out


def in_lockstep(module: torch.nn.Module) -> bool:
    """Whether each forward of `module` is a collective over its ranks, so that every rank must
    make the same forwards, and `generate` must run with `synced_gpus`, where a rank that has
    finished keeps stepping until all have (else the others wait for it in a collective that
    never comes). Two causes: ZeRO-3 partitions left in place (not `gathered`), which each
    forward all-gathers; and DeepSpeed AutoEP's MoE layers (expert parallelism), whose tokens
    travel to their experts' ranks by all-to-all."""
    statuses = (getattr(p, "ds_status", None) for p in module.parameters())
    partitioned = any(s is not None and s.name != "AVAILABLE" for s in statuses)
    return partitioned or bool(autoep.routers(module))
