"""One GRPO step (rollouts, advantages, loss through the engine, curriculum) and the held-out evaluation."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from stagetrain.config.settings import CurriculumSettings
from stagetrain.grpo import shared_prompts
from stagetrain.grpo.completions import CompletionRecord, logged_at, term_values
from stagetrain.grpo.curriculum import (
    Curriculum,
    draw,
    update_all,
    window_rate,
)
from stagetrain.grpo.loss import grpo_loss
from stagetrain.grpo.metrics import GrpoRecord
from stagetrain.grpo.rollouts import Group, flat_groups, tree_groups
from stagetrain.grpo.run import Replay, Run
from stagetrain.grpo.sampling import policy_scores
from stagetrain.tasks import Problem, sample
from stagetrain.training.engine import gathered
from stagetrain.training.experts import (
    Routing,
    autoep_choices,
    chosen_by_position,
    routed_by_position,
    router_biases,
    routing_flips,
)

if TYPE_CHECKING:  # reward_plot's annotation
    from stagetrain.grpo.summary import GrpoSummary


def step_prompts(
    curriculum: Curriculum,
    config: CurriculumSettings,
    *,
    prompts: int,
    seed: int,
    step: int,
    replay: Replay | None = None,
) -> list[Problem]:
    """The whole prompt batch of `step`, for all data-parallel ranks in rank order: families
    uniform, each level from its family's curriculum; with `replay`, `replayed(share, prompts)`
    of them, at places drawn from a stream of their own, replaced by replay problems.

    A pure function of (seed, step, curriculum state), independent of dp, so a
    run resumed under another dp continues the same prompt sequence (the
    curriculum state is the same on every rank and saved with the checkpoint).
    """
    rng = random.Random(f"{seed}:{step}:prompts")
    drawn = draw(curriculum, config, prompts, rng)
    if replay is not None and replay.levels:
        other = random.Random(f"{seed}:{step}:replay")
        for at in sorted(other.sample(range(prompts), replayed(replay.share, prompts, other))):
            family = other.choice(sorted(replay.levels))
            drawn[at] = (family, other.randint(1, replay.levels[family]))
    return [sample(family, level, "train", rng) for family, level in drawn]


def by_reward(terms: Sequence[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """{reward name: {mean, std}} of its unweighted values over the step's completions, NaN
    (a term that gave None) left out, as TRL's rewards/<name>/mean and std; a term that
    applied to no completion is left out."""
    out = {}
    for name in dict.fromkeys(n for n, _ in terms):
        scored = [v for n, v in terms if n == name and not math.isnan(v)]
        if scored:
            out[name] = {"mean": float(np.mean(scored)), "std": float(np.std(scored))}
    return out


def replayed(share: float, prompts: int, rng: random.Random) -> int:
    """How many of a step's `prompts` replay: share * prompts rounded down, plus one with the
    chance of its fraction, so the expected share is `share` exactly. Rounding to the nearest
    whole prompt replayed nothing of 4 prompts at 0.1, and half of them at 0.375."""
    exact = share * prompts
    whole = math.floor(exact)
    return whole + (rng.random() < exact - whole)


def draw_problems(run: Run, curriculum: Curriculum, step_no: int) -> tuple[list[Problem], int]:
    """This data-parallel rank's contiguous share of the step's global prompt batch, and the
    global index of its first prompt."""
    every = step_prompts(curriculum, run.curriculum, prompts=run.cfg.prompts_per_step,
                         seed=run.spec["seed"], step=step_no, replay=run.replay)  # fmt: skip
    n = len(every) // run.layout.dp
    return every[run.dp_rank * n : (run.dp_rank + 1) * n], run.dp_rank * n


class Scored(NamedTuple):
    """`token_logprobs`' result: per completion token its log-prob and mask, (B, T) rows; with
    a routing asked for, the experts each column's position chose, (B, T, MoE layers, top_k),
    and the forward's load-balancing loss where the architecture defines one."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    experts: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def token_logprobs(
    model: Any,
    items: Sequence[tuple[list[int], list[int]]],
    device: torch.device,
    pad: int,
    *,
    temperature: float,
    top_p: float,
    routing: Routing | None = None,
) -> Scored:
    """The log-probs and mask of each completion's tokens given its prompt: (B, T) with T =
    longest sequence - 1. The log-probs are the sampling policy's (`sampling.policy_scores`: the
    rollouts' temperature and top-p), so the loss scores the distribution that sampled. With
    `routing` (an MoE policy's) the experts each position chose too: from the router logits
    the forward returns, or under expert parallelism from AutoEP's routers, which return none.

    Without a routing to record, each distinct prompt runs once (`shared_prompts`); with one,
    every row runs in full, as the routing and the aux loss are defined over whole rows."""
    mask = completion_mask(items, device)
    if routing is None and shared_prompts.applies(model):
        logits, tokens = shared_prompts.completion_logits(model, items, device, pad)
        compact = _policy_logprobs(logits, tokens, temperature, top_p)
        return Scored(shared_prompts.spread(compact, items, mask.shape[1]), mask)
    seqs = [p + c for p, c in items]
    width = _width(items)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    forward = {} if routing is None else {"output_router_logits": True}
    # A dense policy's forward, every micro batch, need not walk the modules for AutoEP's routers.
    choices: AbstractContextManager[list[torch.Tensor]] = (
        autoep_choices(model) if routing is not None else nullcontext([])
    )
    with choices as chosen:
        out = model(input_ids=ids, attention_mask=attention, **forward)
    logprobs = _policy_logprobs(out.logits[:, :-1], ids[:, 1:], temperature, top_p)
    if routing is None:
        return Scored(logprobs, mask)
    if chosen:  # expert parallelism: AutoEP's routers return no logits
        experts = routed_by_position(chosen, len(items), routing.top_k)[:, :-1]
    else:
        biases = router_biases(model) if routing.bias_rate is not None else None
        experts = chosen_by_position(out.router_logits, len(items), routing, biases)[:, :-1]
    aux = out.aux_loss.float() if routing.coef is not None else None
    return Scored(logprobs, mask, experts, aux)


def _policy_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """Each token's log-prob under the sampling policy of the logits that predict it."""
    scores = policy_scores(logits, temperature, top_p, keep=tokens)
    return scores.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def routing_flip_sums(
    trainer: torch.Tensor,
    sampled: Sequence[torch.Tensor],
    items: Sequence[tuple[list[int], list[int]]],
) -> tuple[int, int]:
    """(pairs whose experts differ, pairs) over the completion tokens and MoE layers of `items`:
    the trainer's routing (`Scored.experts`) at each token's column against the sampler's
    (`sampling.RoutingRecorder`, one (tokens, layers, top_k) per completion; -1 where the
    sampler drew no token: a tree's stand-in eos)."""
    flips = pairs = 0
    for row, ((p, c), mine) in enumerate(zip(items, sampled, strict=True)):
        drew = (mine >= 0).all(-1)
        flips += routing_flips(
            trainer[row, len(p) - 1 : len(p) - 1 + len(c)].cpu()[drew], mine[drew]
        )
        pairs += int(drew.sum())
    return flips, pairs


def _width(items: Sequence[tuple[list[int], list[int]]]) -> int:
    return max(len(p) + len(c) for p, c in items)


def completion_mask(
    items: Sequence[tuple[list[int], list[int]]], device: torch.device
) -> torch.Tensor:
    """1 at each completion token's column of `token_logprobs`' (B, T) rows, else 0."""
    mask = torch.zeros((len(items), _width(items) - 1), device=device)
    for row, (p, c) in enumerate(items):
        mask[row, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
    return mask


def _token_rows(
    values: Sequence[torch.Tensor | Sequence[float]],
    items: Sequence[tuple[list[int], list[int]]],
    width: int,
    fill: float = 0.0,
) -> torch.Tensor:
    """Per-completion-token values laid out as `token_logprobs`' (B, T) columns."""
    rows = torch.full((len(items), width), fill)
    for row, ((p, c), value) in enumerate(zip(items, values, strict=True)):
        rows[row, len(p) - 1 : len(p) - 1 + len(c)] = torch.as_tensor(value, dtype=torch.float32)
    return rows


def train_on(run: Run, groups: list[Group]) -> tuple[float, dict[str, float | None]]:
    """`passes` optimizer steps on the rollouts: exactly grad_accum micro batches each, through the
    engine. The loss is normalised over the global batch (`_weights`), so the update and the
    logged loss (the last pass's, over the global batch) do not depend on dp or grad_accum.
    Before any update, the trainer's log-probs of the sampled tokens are compared with the
    sampler's (`sampler_gap`), and with `grpo.sampler_correction` the policy-gradient term of
    each token is weighted by the truncated importance ratio trainer / sampler. An MoE policy's
    routing is compared alike (`routing_flip_sums`), and `grpo.router_aux_loss_coef` adds its
    load-balancing loss."""
    cfg, engine = run.cfg, run.engine
    items = [(g.prompt, c) for g in groups for c in g.completions]
    keep = [g.varies for g in groups for _ in g.completions]  # groups without signal are dropped
    drawn = [lp for g in groups for lp in g.sampler_logprobs]
    routed = [r for g in groups for r in g.sampler_routing]
    measure = run.routing is not None and len(routed) == len(items)
    moe = [0.0, 0.0, 0.0]  # routing flips, (token, layer) pairs, aux loss summed over micro batches
    pad, ga = run.tokenizer.pad_token_id, run.layout.grad_accum
    policy = {"temperature": cfg.temperature, "top_p": cfg.top_p}
    chunks = np.array_split(np.arange(len(items)), ga)
    old, masks, ref, sampler = _before_update(run, [[items[i] for i in c] for c in chunks],
                                              [[drawn[i] for i in c] for c in chunks])  # fmt: skip
    advs = [a for g in groups for a in g.advantages]
    # The KL term holds every sampled completion to the reference, groups without reward
    # variance included: their policy gradient is zero, but they are most of what the policy
    # already knows, and the KL is what keeps it (normalised over all completions).
    sizes = normaliser_sizes(chunks, keep, items, cfg.loss_type)
    kl_sizes = normaliser_sizes(chunks, [True] * len(items), items, cfg.loss_type) if ref else []
    tokens = float(sum(len(c) for _, c in items)) if ref else 0.0
    normaliser, kl_normaliser, completion_tokens = _dp_sums(
        run, [sum(sizes), sum(kl_sizes), tokens]
    )
    weights = _shares(sizes, normaliser)
    kl_weights = _shares(kl_sizes, kl_normaliser) if ref else None
    loss_value, stats, kl_mean, gap = 0.0, None, None, None
    flipped: float  # the micro batch's sums, then every rank's (`_dp_sums`)
    pairs: float
    for n in range(cfg.passes):
        loss_value, kl_sum, moe[2] = 0.0, 0.0, 0.0
        for k, chunk in enumerate(chunks):
            mine = [items[i] for i in chunk]
            routing = run.routing if cfg.router_aux_loss_coef or (measure and not n) else None
            scored = token_logprobs(engine, mine, run.device, pad, **policy, routing=routing)
            logprobs, mask = scored.logprobs, scored.mask
            if old[k] is None:  # the first pass runs at the weights the rollouts sampled with
                old[k] = logprobs.detach()
            if measure and not n:
                flipped, pairs = routing_flip_sums(scored.experts, [routed[i] for i in chunk], mine)
                moe[0] += flipped
                moe[1] += pairs
            kept = mask * torch.tensor(
                [float(keep[i]) for i in chunk], device=mask.device
            ).unsqueeze(1)
            adv = _token_rows(
                [advs[i] for i in chunk], [items[i] for i in chunk], mask.shape[1]
            ).to(mask.device)
            correction = None
            if cfg.sampler_correction is not None:
                correction = truncated_importance(old[k], sampler[k], cfg.sampler_correction.cap)
            common: dict[str, Any] = {
                "eps_low": cfg.clip_eps_low,
                "eps_high": cfg.clip_eps_high,
                "loss_type": cfg.loss_type,
                "max_length": cfg.max_new_tokens,
            }
            loss, stats = grpo_loss(
                logprobs, old[k], None, adv, kept, beta=0.0, token_weights=correction, **common
            )
            total = loss * weights[k]
            if kl_weights is not None:
                assert ref is not None  # kl_weights come with the reference's log-probs
                kl, kl_stats = grpo_loss(
                    logprobs,
                    old[k],
                    ref[k],
                    torch.zeros_like(adv),
                    mask,
                    beta=cfg.kl_coef,
                    **common,
                )
                total = total + kl * kl_weights[k]
                assert kl_stats.kl_mean is not None  # beta = kl_coef > 0
                kl_sum += kl_stats.kl_mean * kl_stats.tokens
            if cfg.router_aux_loss_coef:  # the mean over every micro batch of every rank
                assert scored.aux_loss is not None  # routing is asked for with the coefficient
                total = total + cfg.router_aux_loss_coef * scored.aux_loss / (ga * run.layout.dp)
                moe[2] += float(scored.aux_loss.detach())
            # DeepSpeed divides by grad_accum and averages over dp: both undone, so the
            # gradient is that of the global batch's loss.
            engine.backward(total * ga * run.layout.dp)
            engine.step()
            loss_value += float(total.detach())
        if gap is None:
            gap = [gap_sums(t, s, m) for t, s, m in zip(old, sampler, masks, strict=True)]
    assert stats is not None and gap is not None  # set by the first pass (passes >= 1)
    # One all-reduce for every sum the step logs: each collective waits for the slower rank.
    loss_value, kl_sum, flipped, pairs, aux, *sums = _dp_sums(
        run, [loss_value, kl_sum, *moe, *(sum(p[i] for p in gap) for i in (0, 2, 3))]
    )
    kl_mean = kl_sum / max(completion_tokens, 1.0) if kl_weights is not None else None
    out = {"clip_ratio/low_mean": stats.clip_ratio_low, "clip_ratio/high_mean": stats.clip_ratio_high,
           "kl": kl_mean, **sampler_gap(run, gap, sums)}  # fmt: skip
    if measure:
        out["moe/routing_flip_share"] = flipped / pairs if pairs else 0.0
    if cfg.router_aux_loss_coef:
        out["train/aux_loss"] = aux / (ga * run.layout.dp)
    return loss_value, out


def _before_update(
    run: Run, items: list[list[tuple[list[int], list[int]]]], drawn: list[list[list[float]]]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
    """Per micro batch, before the step's first update: the policy's log-probs ("old") and
    completion masks, the reference's log-probs (None without one) and the sampler's, as rows.

    With one pass, "old" is left None for `train_on` to fill with its first forward's log-probs,
    detached: the weights change only at the end of that pass's accumulation, so every micro
    batch of it runs at the weights that sampled, and a forward of its own would compute the
    same values again (a third of the step's forwards; TRL skips it alike)."""
    policy: dict[str, Any] = {"temperature": run.cfg.temperature, "top_p": run.cfg.top_p}
    pad = run.tokenizer.pad_token_id
    with torch.no_grad():
        masks = [completion_mask(c, run.device) for c in items]
        old: list[torch.Tensor | None] = [None] * len(items)
        if run.cfg.passes > 1:
            old = [token_logprobs(run.engine, c, run.device, pad, **policy)[0] for c in items]
        ref = None
        if run.reference is not None:
            ref = [token_logprobs(run.reference, c, run.device, pad, **policy)[0] for c in items]
    sampler = [_token_rows(d, c, m.shape[1], fill=float("nan")).to(m.device)
               for c, d, m in zip(items, drawn, masks, strict=True)]  # fmt: skip
    return old, masks, ref, sampler


def truncated_importance(trainer: torch.Tensor, sampler: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(trainer - sampler), cap) per token, 1 where the sampler's log-prob is unknown:
    truncated importance sampling (TIS), the weight verl and TRL put on each token's
    policy-gradient term when the sampler's kernels differ from the trainer's."""
    ratio = torch.exp(torch.nan_to_num(trainer - sampler, nan=0.0)).clamp(max=cap)
    return ratio.detach()


def gap_sums(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float, float, int]:
    """(sum |trainer - sampler|, max of it, sum of k3, tokens) over the completion tokens whose
    sampler log-prob is known. k3 = r - 1 - log r with r = trainer / sampler is Schulman's
    estimator of KL(sampler || trainer) from the sampler's own draws."""
    known = mask.bool() & sampler.isfinite()
    delta = (trainer - sampler)[known].double()
    if not delta.numel():
        return 0.0, 0.0, 0.0, 0
    k3 = delta.exp() - 1 - delta
    return float(delta.abs().sum()), float(delta.abs().max()), float(k3.sum()), int(delta.numel())


def sampler_gap(
    run: Run, parts: Sequence[tuple[float, float, float, int]], sums: Sequence[float]
) -> dict[str, float]:
    """The step's sampler-trainer gap over every rank's completion tokens: mean and max of
    |log-prob difference| and the mean k3 KL, from this rank's `gap_sums` per micro batch and
    their |difference|, k3 and token sums over every rank."""
    total, kl, tokens = sums
    return {
        "train/sampler_logprob_gap_mean": total / tokens if tokens else 0.0,
        "train/sampler_logprob_gap_max": _dp_max(run, [max((p[1] for p in parts), default=0.0)])[0],
        "train/sampler_kl": kl / tokens if tokens else 0.0,
    }


def _shares(sizes: Sequence[float], total: float) -> list[float]:
    """Each micro batch's share of the global batch's normaliser: its `normaliser_sizes` over
    their sum on every dp rank (so the update does not depend on how dp and accumulation cut
    the batch)."""
    return [s / total if total else 0.0 for s in sizes]


def normaliser_sizes(chunks: Sequence[np.ndarray], keep: Sequence[bool],
                     items: Sequence[tuple[list[int], list[int]]], loss_type: str) -> list[float]:  # fmt: skip
    """What each micro batch adds to its loss type's normaliser: kept completion tokens
    ("dapo"), kept non-empty completions ("grpo") or rows ("dr_grpo"). A micro batch's loss
    times its size over the global sum, summed over every micro batch of every rank, is the
    loss of the global batch in one piece, however the batch is split."""

    def size(c: np.ndarray) -> float:
        kept = [i for i in c if keep[i]]
        if loss_type == "dapo":
            return float(sum(len(items[i][1]) for i in kept))
        if loss_type == "grpo":
            return float(sum(1 for i in kept if items[i][1]))
        return float(len(c))

    return [size(c) for c in chunks]


class Row(NamedTuple):
    """What every rank reports of one prompt of the step, for the curriculum and the metrics."""

    family: str
    level: int
    rewards: list[float]
    solved: list[bool]
    """Whether each completion's reward reaches its family's `tasks.success_at`."""
    varies: bool
    generated: int
    flat: int
    nodes: int
    lengths: list[int]
    """Tokens of each completion."""
    clipped: int
    """Completions cut at grpo.max_new_tokens, without an eos."""
    trained: int
    """Prompt and completion tokens one optimisation pass runs through the model."""
    key: str
    """The problem's identity (for the debug prompt log)."""
    prompt_ids: list[int]
    """What the model was given (for the debug prompt log)."""


def gather_dp(values: list[Any], dp_rank: int) -> list[Any]:
    """Every data-parallel rank's `values`, in dp order. The ranks of one tensor-parallel group
    draw the same prompts and sample the same completions, so each dp rank counts once."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, (dp_rank, values))
    by_dp = dict(out)
    return [v for rank in sorted(by_dp) for v in by_dp[rank]]


def _rollouts(
    run: Run,
    prompts: list[list[int]],
    reward: Callable[[int, list[int]], float],
    keys: list[tuple[int, int, int]],
) -> tuple[list[Group], Counted]:
    """This rank's groups of the step, flat or tree, generated in eval mode with the policy
    gathered (ZeRO-3, unless the plan gathers per token), and the policy's `Counted` calls;
    the engine is back in train mode after. `keys` name each prompt's sampling stream: (seed,
    step, the prompt's index in the global batch), so its completions do not depend on which
    rank draws it."""
    cfg, tok = run.cfg, run.tokenizer
    run.engine.eval()
    model = Counted(run.engine.module)
    with gathered(run.engine, whole=run.gather_whole), torch.no_grad():
        common = {
            "keys": keys,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "pad_id": tok.pad_token_id,
            "routing": run.routing,
        }
        if run.tree:
            groups = tree_groups(model, prompts, reward, run.tree,
                                 max_batch=run.generation_batch, **common)  # fmt: skip
        else:
            groups = flat_groups(model, prompts, reward, group_size=cfg.group_size,
                                 max_new_tokens=cfg.max_new_tokens, eos_id=tok.eos_token_id,
                                 max_batch=run.generation_batch, **common)  # fmt: skip
    run.engine.train()
    return groups, model


class Counted:
    """The policy as rollouts call it, recording the most sequences one `generate` call makes
    (the plan's generation batch bounds it: its KV cache is what the plan counted) and how many
    calls ran in lockstep (per-token gathering, expert parallelism); the metrics show both."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.largest, self.lockstep = module, 0, 0

    def generate(self, **kwargs: Any) -> Any:
        self.largest = max(self.largest, int(kwargs["input_ids"].shape[0]))
        self.lockstep += bool(kwargs.get("synced_gpus"))
        return self.module.generate(**kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class Stepped(NamedTuple):
    """What one step did: its metrics record (the loop adds the timings and, at an evaluation,
    the accuracy), the tokens it generated and trained on, for the debug prompt log the
    problem keys and prompt ids of the step, dp ranks in order, and its completions table."""

    record: GrpoRecord
    tokens: int
    prompts: list[str]
    prompt_ids: list[list[int]]
    completions: list[CompletionRecord]
    """The step's rows of the completions table, dp ranks in order; empty at a step that
    logs none (`grpo.log_completions_every`)."""


def step(
    run: Run,
    curriculum: Curriculum,
    step_no: int,
) -> Stepped:
    """Rollouts, training and the curriculum update of one step; its metrics record."""
    cfg, judge, eos = run.cfg, run.judge, run.tokenizer.eos_token_id
    batch, first = draw_problems(run, curriculum, step_no)
    judge.at_step(step_no - 1, cfg.steps)  # TRL counts the steps completed before this one
    prompts = [judge.prompt_ids(p) for p in batch]
    keys = [(run.spec["seed"], step_no, first + i) for i in range(len(batch))]

    table = logged_at(cfg.log_completions_every, step_no, cfg.steps)
    scored: dict[tuple[int, tuple[int, ...]], tuple[dict[str, float | None], dict[str, Any]]] = {}
    context = judge.context

    def reward(i: int, completion: list[int]) -> float:
        if not table:
            return judge.rewards([batch[i]], [completion])[0]
        terms, extra = len(context.terms), {k: len(v) for k, v in context.log.extra.items()}
        value = judge.rewards([batch[i]], [completion])[0]
        # one completion per call: what the call added is this completion's
        scored[(i, tuple(completion))] = (
            term_values(context.terms[terms:]),
            {
                k: v[extra.get(k, 0)]
                for k, v in context.log.extra.items()
                if len(v) > extra.get(k, 0)
            },
        )
        return value

    for sink in (context.terms, context.log.metrics, context.log.extra):
        sink.clear()  # what the step's scoring adds
    groups, counted = _rollouts(run, prompts, reward, keys)
    completions = (
        gather_dp(_completion_records(run, step_no, batch, groups, scored), run.dp_rank)
        if table
        else []
    )
    terms = gather_dp(judge.context.terms, run.dp_rank)
    logged = gather_dp(list(judge.context.log.metrics.items()), run.dp_rank)
    largest, lockstep = _dp_max(run, [counted.largest, counted.lockstep])
    loss, clip = train_on(run, groups)
    rows: list[Row] = gather_dp([
        Row(family=p.family, level=p.level, rewards=g.rewards, solved=[judge.solved(p, r) for r in g.rewards],
            varies=g.varies, generated=g.generated_tokens,
            flat=g.flat_tokens, nodes=g.nodes, lengths=[len(c) for c in g.completions],
            clipped=sum(len(c) >= cfg.max_new_tokens and c[-1] != eos for c in g.completions),
            trained=sum(len(g.prompt) + len(c) for c in g.completions), key=p.key, prompt_ids=g.prompt)
        for g, p in zip(groups, batch, strict=True)
    ], run.dp_rank)  # fmt: skip

    rewards = [r for row in rows for r in row.rewards]
    levels = curriculum.levels()  # those the step's prompts were drawn at
    # A prompt succeeds when most of its completions do; only current-level ones reach the window.
    outcomes = [(row.family, row.level, float(np.mean(row.solved) >= 0.5)) for row in rows]
    events = update_all(curriculum, run.curriculum, step_no, outcomes)
    decided = {e["family"]: e["success_rate"] for e in events}  # the window a change emptied
    record: GrpoRecord = {
        "step": step_no, "train/loss": loss, "train/lr": run.engine.get_lr()[0],
        "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)), "reward/max": max(rewards),
        "reward/solved": sum(sum(row.solved) for row in rows) / len(rewards),
        "frac_reward_zero_std": float(np.mean([not row.varies for row in rows])),
        "completions/mean_length": float(np.mean([n for row in rows for n in row.lengths])),
        "completions/max_length": max(n for row in rows for n in row.lengths),
        "completions/clipped_ratio": sum(row.clipped for row in rows) / len(rewards),
        "rollout/generated_tokens": sum(row.generated for row in rows),
        "rollout/largest_generate_call": int(largest),
        "rollout/lockstep_generate_calls": int(lockstep),
        "curriculum/level": levels,
        "curriculum/success_rate": {f: decided.get(f, window_rate(s)) for f, s in curriculum.states.items()},
        "clip_ratio/low_mean": clip["clip_ratio/low_mean"], "clip_ratio/high_mean": clip["clip_ratio/high_mean"],
        # train_on's statistics by name, GrpoRecord's keys (MetricsLog refuses any other)
        **{k: v for k, v in clip.items() if k.startswith(("train/sampler_", "moe/", "train/aux"))},  # type: ignore[typeddict-item]
    }  # fmt: skip
    record["reward/by_level"] = {
        str(level): float(np.mean([r for row in rows if row.level == level for r in row.rewards]))
        for level in sorted({row.level for row in rows})
    }
    record["rewards"] = by_reward(terms)
    if logged:
        record["rewards/logged"] = {name: float(np.mean([v for n, vs in logged if n == name for v in vs]))
                                    for name in dict.fromkeys(n for n, _ in logged)}  # fmt: skip
    if run.replay is not None:
        record["replay/share"] = sum(row.family in run.replay.levels for row in rows) / len(rows)
    if run.tree:
        leaves = len(rewards)
        record["rollout/flat_equivalent_tokens"] = sum(row.flat for row in rows)
        record["tree/leaves"] = leaves
        record["tree/nodes"] = sum(row.nodes for row in rows)
        record["tree/tokens_per_leaf"] = record["rollout/generated_tokens"] / leaves
    if cfg.kl_coef > 0:
        kl = clip["kl"]
        assert kl is not None  # train_on measures it against the reference
        record["kl"] = kl
    if events:
        record["curriculum/events"] = events
    trained = sum(row.trained for row in rows) * cfg.passes
    return Stepped(record, record["rollout/generated_tokens"] + trained,
                   [row.key for row in rows], [row.prompt_ids for row in rows], completions)  # fmt: skip


def _completion_records(
    run: Run, step_no: int, batch: Sequence[Problem], groups: Sequence[Group],
    scored: Mapping[tuple[int, tuple[int, ...]], tuple[dict[str, float | None], dict[str, Any]]],
) -> list[CompletionRecord]:  # fmt: skip
    """This rank's rows of the completions table. A tree leaf never scored (unfinished when its
    budget ran out) has no terms: its reward is the tree's 0, not a function's."""
    out: list[CompletionRecord] = []
    for i, (problem, group) in enumerate(zip(batch, groups, strict=True)):
        prompt = run.tokenizer.decode(group.prompt, skip_special_tokens=False)
        for ids, value, advantage in zip(
            group.completions, group.rewards, group.advantages, strict=True
        ):
            terms, extra = scored.get((i, tuple(ids)), ({}, {}))
            seen = run.judge.prompter.completion(ids)
            out.append({"step": step_no, "family": problem.family, "level": problem.level, "prompt": prompt,
                        "completion": seen.text, "completion_ids": seen.ids, "reward": value, "rewards": terms,
                        "advantage": float(advantage.float().mean()) if advantage.numel() else 0.0,
                        "extra": extra})  # fmt: skip
    return out


def _dp_sums(run: Run, values: Sequence[float]) -> list[float]:
    """The sums of `values` over the data-parallel ranks, in one all-reduce (the ranks of a
    tensor-parallel group hold the same rows, so each dp rank counts once)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=run.device)  # NCCL: on the GPU
    dist.all_reduce(tensor)
    return [v / run.layout.tp for v in tensor.tolist()]


def _dp_max(run: Run, values: Sequence[float]) -> list[float]:
    """The largest of each of `values` over every rank, in one all-reduce."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=run.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def reward_plot(summary: GrpoSummary, path: str | Path) -> None:
    """Mean reward per step, every held-out evaluation of every family (a family GRPO does not
    train shows here what training the others cost it), and each family's curriculum level,
    as a PNG for the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    rewards = {int(k): v for k, v in summary["rewards"].items()}
    ax.plot(list(rewards), list(rewards.values()), color="C0", alpha=0.6,
            label="mean reward (training prompts)")  # fmt: skip
    evaluations = {int(k): v for k, v in summary["evaluations"].items()}
    evaluated = sorted({f for by_family in evaluations.values() for f in by_family})
    for i, family in enumerate(evaluated):
        steps = [s for s in sorted(evaluations) if family in evaluations[s]]
        ax.plot(steps, [evaluations[s][family] for s in steps], "o--", color=f"C{(i + 1) % 10}",
                label=f"held-out accuracy: {family}")  # fmt: skip
    levels = {int(k): v for k, v in summary["levels"].items()}  # step -> {family: level}
    twin = ax.twinx()
    families = sorted({f for by_family in levels.values() for f in by_family})
    for i, family in enumerate(families):
        steps = [s for s in levels if family in levels[s]]
        # Offset a little so that families at the same level stay visible.
        offset = 0.04 * (i - (len(families) - 1) / 2)
        twin.step(
            steps,
            [levels[s][family] + offset for s in steps],
            where="post",
            color=f"C{(i + 1 + len(evaluated)) % 10}",
            linewidth=2,
            alpha=0.4,
            label=f"level: {family}",
        )
    top = max((lv for by_family in levels.values() for lv in by_family.values()), default=1)
    twin.set_ylabel("curriculum level (per family)")
    twin.set_ylim(0.5, top + 0.5)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    acc = summary["accuracy"]
    ax.set_title(
        f"grpo: held-out accuracy {acc['start']:.2f} -> {acc['end']:.2f} (mean of families)"
    )
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax.legend(handles + twin_handles, labels + twin_labels, fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
