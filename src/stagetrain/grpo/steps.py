"""One GRPO step (rollouts, advantages, loss through the engine, curriculum) and the held-out evaluation."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stagetrain.grpo.curriculum import levels_for, update
from stagetrain.grpo.loss import grpo_loss
from stagetrain.grpo.rollouts import Group, flat_groups, tree_groups
from stagetrain.tasks import FAMILIES, Problem, prompt, sample, score


def prompt_ids(tokenizer: Any, problem: Problem, limit: int) -> list[int]:
    """The prompt's token ids, keeping its last `limit` tokens (the question's end and the answer marker)."""
    return tokenizer(prompt(problem), add_special_tokens=False)["input_ids"][-limit:]


def greedy_scores(
    model: Any, tokenizer: Any, batch: Sequence[Problem], cfg: Mapping[str, Any]
) -> list[float]:
    """Verifier scores of greedy completions (KV cache, batches of 64)."""
    out = []
    for start in range(0, len(batch), 64):
        chunk = batch[start : start + 64]
        ids = [prompt_ids(tokenizer, p, cfg["max_prompt_len"]) for p in chunk]
        width = max(map(len, ids))
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        device = next(model.parameters()).device
        tokens = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        gen = model.generate(input_ids=tokens, attention_mask=mask, do_sample=False, max_new_tokens=cfg["max_new_tokens"],
                             eos_token_id=eos, pad_token_id=pad, use_cache=True, synced_gpus=False)  # fmt: skip
        texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=False)
        out.extend(score(t, p) for t, p in zip(texts, chunk, strict=True))
    return out


def draw_problems(run: Any, state: Any, rng: random.Random) -> list[Problem]:
    """This rank's prompts of the step: levels from the curriculum, families uniform."""
    n = run.cfg["prompts_per_step"] // run.layout["dp"]
    families = run.cfg["curriculum"]["families"]
    chosen = []
    for level in levels_for(state, run.curriculum, n, rng):
        family = rng.choice(families)
        chosen.append(sample(family, min(level, FAMILIES[family].max_level), "train", rng))
    return chosen


def token_logprobs(
    model: Any, items: Sequence[tuple[list[int], list[int]]], device: torch.device, pad: int
):  # noqa: ANN201
    """(logprobs, mask) of each completion's tokens given its prompt: (B, T) with T = longest sequence - 1."""
    seqs = [p + c for p, c in items]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = torch.zeros_like(logprobs)
    for row, (p, c) in enumerate(items):
        mask[row, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
    return logprobs, mask


def _advantage_rows(
    items_adv: Sequence[torch.Tensor], items: Sequence[tuple[list[int], list[int]]], width: int
) -> torch.Tensor:
    rows = torch.zeros(len(items), width)
    for row, ((p, c), adv) in enumerate(zip(items, items_adv, strict=True)):
        rows[row, len(p) - 1 : len(p) - 1 + len(c)] = adv
    return rows


def train_on(run: Any, groups: list[Group]) -> tuple[float, dict[str, float | None]]:
    """`passes` optimizer steps on the rollouts: exactly grad_accum micro batches each, through the engine."""
    cfg, engine = run.cfg, run.engine
    items = [(g.prompt, c) for g in groups for c in g.completions]
    keep = [g.varies for g in groups for _ in g.completions]  # groups without signal are dropped
    pad, ga = run.tokenizer.pad_token_id, run.layout["grad_accum"]
    chunks = np.array_split(np.arange(len(items)), ga)
    with torch.no_grad():
        old = [token_logprobs(engine, [items[i] for i in c], run.device, pad)[0] for c in chunks]
        ref = (
            [
                token_logprobs(run.reference, [items[i] for i in c], run.device, pad)[0]
                for c in chunks
            ]
            if run.reference
            else None
        )
    advs = [a for g in groups for a in g.advantages]
    loss_value, stats = 0.0, None
    for _ in range(cfg["passes"]):
        for k, chunk in enumerate(chunks):
            logprobs, mask = token_logprobs(engine, [items[i] for i in chunk], run.device, pad)
            mask = mask * torch.tensor(
                [float(keep[i]) for i in chunk], device=mask.device
            ).unsqueeze(1)
            adv = _advantage_rows(
                [advs[i] for i in chunk], [items[i] for i in chunk], mask.shape[1]
            ).to(mask.device)
            loss, stats = grpo_loss(logprobs, old[k], ref[k] if ref else None, adv, mask,
                                    eps_low=cfg["clip_eps_low"], eps_high=cfg["clip_eps_high"], beta=cfg["kl_coef"],
                                    loss_type=cfg["loss_type"], max_length=cfg["max_new_tokens"])  # fmt: skip
            weight = _weights_for(chunk, chunks, keep, items, cfg["loss_type"])
            engine.backward(loss * weight * ga)
            engine.step()
            loss_value = float(loss.detach())
    return loss_value, {"clip_ratio/low_mean": stats.clip_ratio_low, "clip_ratio/high_mean": stats.clip_ratio_high,
                        "kl": stats.kl_mean}  # fmt: skip


def _weights_for(chunk: np.ndarray, chunks: list[np.ndarray], keep: list[bool],
                 items: Sequence[tuple[list[int], list[int]]], loss_type: str) -> float:  # fmt: skip
    """This micro batch's share of the rank batch's normaliser (tokens, sequences or rows by loss type)."""

    def size(c: np.ndarray) -> float:
        kept = [i for i in c if keep[i]]
        if loss_type == "dapo":
            return float(sum(len(items[i][1]) for i in kept))
        if loss_type == "grpo":
            return float(sum(1 for i in kept if items[i][1]))
        return float(len(c))

    total = sum(size(c) for c in chunks)
    return size(chunk) / total if total else 0.0


def _gather(values: list[Any]) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def step(
    run: Any, state: Any, step_no: int, rng: random.Random, gathered: Callable[[Any], Any]
) -> dict[str, Any]:
    """Rollouts, training and the curriculum update of one step; its metrics record."""
    cfg, tok = run.cfg, run.tokenizer
    batch = draw_problems(run, state, rng)
    prompts = [prompt_ids(tok, p, cfg["max_prompt_len"]) for p in batch]

    def reward(i: int, completion: list[int]) -> float:
        return score(tok.decode(completion, skip_special_tokens=False), batch[i])

    run.engine.eval()
    with gathered(run), torch.no_grad():
        common = {
            "temperature": cfg["temperature"],
            "top_p": cfg["top_p"],
            "pad_id": tok.pad_token_id,
        }
        if run.tree:
            groups = tree_groups(run.engine.module, prompts, reward, run.tree, **common)
        else:
            groups = flat_groups(run.engine.module, prompts, reward, group_size=cfg["group_size"],
                                 max_new_tokens=cfg["max_new_tokens"], eos_id=tok.eos_token_id, **common)  # fmt: skip
    run.engine.train()
    loss, clip = train_on(run, groups)
    levels = [p.level for p in batch]
    rows = _gather([(g.rewards, g.varies, lvl, g.generated_tokens, g.flat_tokens, len(g.prompt), g.nodes)
                    for g, lvl in zip(groups, levels, strict=True)])  # fmt: skip

    rewards = [r for row in rows for r in row[0]]
    current = [float(np.mean(row[0]) >= 0.5) for row in rows if row[2] == state.level]
    record = {
        "train/loss": _mean_over_ranks(loss), "train/lr": run.engine.get_lr()[0],
        "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
        "frac_reward_zero_std": float(np.mean([not row[1] for row in rows])),
        "completions/mean_length": float(np.mean([len(c) for g in groups for c in g.completions])),
        "rollout/generated_tokens": sum(row[3] for row in rows),
        "curriculum/level": state.level, "curriculum/success_rate": float(np.mean(current)) if current else 0.0,
        "clip_ratio/low_mean": clip["clip_ratio/low_mean"], "clip_ratio/high_mean": clip["clip_ratio/high_mean"],
    }  # fmt: skip
    record["reward/by_level"] = {
        str(level): float(np.mean([r for row in rows if row[2] == level for r in row[0]]))
        for level in sorted({row[2] for row in rows})
    }
    if run.tree:
        leaves = sum(len(row[0]) for row in rows)
        record["rollout/flat_equivalent_tokens"] = sum(row[4] for row in rows)
        record["tree/leaves"] = leaves
        record["tree/nodes"] = sum(row[6] for row in rows)
        record["tree/tokens_per_leaf"] = record["rollout/generated_tokens"] / leaves
    if cfg["kl_coef"] > 0:
        record["kl"] = clip["kl"]
    event = update(state, run.curriculum, step_no, current)
    if event:
        record["curriculum/event"] = event
    trained = sum(
        len(c) + row[5] for g, row in zip(groups, rows, strict=False) for c in g.completions
    )
    record["_tokens"] = record["rollout/generated_tokens"] + trained * cfg["passes"]
    return record


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def reward_plot(summary: Mapping[str, Any], path: str | Path) -> None:
    """Mean reward per step and held-out accuracy at the start and the end, as a PNG for the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    rewards = {int(k): v for k, v in summary["rewards"].items()}
    ax.plot(list(rewards), list(rewards.values()), label="mean reward (training prompts)")
    acc = summary["accuracy"]
    ax.plot(
        [0, summary["final_step"]], [acc["start"], acc["end"]], "o--", label="held-out accuracy"
    )
    levels = {int(k): v for k, v in summary["levels"].items()}
    twin = ax.twinx()
    twin.step(
        list(levels),
        list(levels.values()),
        where="post",
        color="grey",
        alpha=0.6,
        label="curriculum level",
    )
    twin.set_ylabel("curriculum level")
    twin.set_ylim(0.5, max(levels.values(), default=1) + 0.5)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(f"grpo: held-out accuracy {acc['start']:.2f} -> {acc['end']:.2f}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
