"""The rollouts' one sampler: a left-padded, KV-cached `generate` call and how its rows are cut.

Flat rollouts, tree rounds with and without the prefix cache all sample through `generate`
here, so they share the logits processors, the padding and the cut of each row (after the
first eos; at a sampled pad; for a tree with `branch_entropy`, before the first uncertain
token), and cached and uncached trees stay equal in distribution.

Each row samples from its own generator (`RowSampler`), seeded by the caller per prompt and
completion, not from torch's global one: a prompt's completions are then the same whichever
rank draws it and whatever else shares its batch, so a run resumed under another
data-parallel size samples what the uninterrupted run sampled. transformers' `generate` draws
every row from the global generator (`torch.multinomial`), hence the Gumbel-max processor.

The sampler and the trainer read one policy: `policy_scores` turns logits into what is sampled
from (divided by the temperature, outside the top-p nucleus -inf), and both `RowSampler` and
the GRPO loss's log-probs (`grpo.steps.token_logprobs`) call it, so the ratio and the gradient
are those of the distribution the completions came from. The sampler records the log-prob of
each token it drew, so the step can measure what is left of the gap (kernels, KV cache, bf16).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import Any, NamedTuple

import torch
from transformers import Cache, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import TopPLogitsWarper

from stagetrain.training import autoep
from stagetrain.training.evaluation import in_lockstep
from stagetrain.training.experts import (
    Routing,
    chosen_by_position,
    routed_by_position,
    router_biases,
)


def generation_kwargs(
    temperature: float, top_p: float, eos_id: int, pad_id: int, greedy: bool = False
) -> dict:
    """`generate`'s arguments; `greedy` takes the most likely token (for tests), otherwise
    `generate` samples at this temperature and top-p from per-row generators."""
    tokens = {"eos_token_id": eos_id, "pad_token_id": pad_id}
    if greedy:
        return tokens
    return tokens | {"temperature": temperature, "top_p": top_p}


def cache_argument(model: Any) -> str:
    """The keyword under which `model`'s forward and `generate` take a KV cache: `cache` in
    transformers 5.2x, `past_key_values` before (5.17, the GPU image's). An unknown keyword
    is swallowed by the forward's `**kwargs`, and the cache then silently left empty."""
    model_type = type(getattr(model, "module", model))  # a DeepSpeed engine's model
    # mypy holds a class to Hashable by its instances' __hash__; a class is hashable
    return _cache_argument(model_type)  # type: ignore[arg-type]


@cache
def _cache_argument(model_type: type[torch.nn.Module]) -> str:
    return (
        "cache"
        if "cache" in inspect.signature(model_type.forward).parameters
        else "past_key_values"
    )


def left_padded(
    rows: Sequence[Sequence[int]], pad: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows left-padded to one width: (ids, attention mask, position ids), positions
    counted from each row's first token, as `generate` makes them, so a row's keys and values
    do not depend on what else shares its batch."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def stream_seed(*key: object) -> int:
    """A generator seed from a key such as (run seed, step, prompt, completion): stable across
    processes and Python versions (unlike `hash`)."""
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def policy_scores(
    logits: torch.Tensor, temperature: float, top_p: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits as the sampling policy draws from them: float, divided by the temperature,
    and -inf outside the top-p nucleus (transformers' `TopPLogitsWarper`). Their log-softmax is
    the sampling policy's log-probabilities.

    `keep` (token ids, one per position of `logits`' leading dimensions) stays in the nucleus
    whatever its mass: the trainer scores tokens that were sampled, and a policy moved by a
    step may push one out of its own nucleus, where its log-prob would be -inf (and its
    KL term infinite). At the weights that sampled it a sampled token is inside anyway.
    """
    scores = logits.float() / temperature
    if top_p >= 1.0:
        return scores
    flat = scores.reshape(-1, scores.shape[-1])
    masked = TopPLogitsWarper(top_p)(None, flat)
    if keep is not None:
        index = keep.reshape(-1, 1)
        masked = masked.scatter(-1, index, flat.gather(-1, index))
    return masked.reshape(scores.shape)


class RowSampler(LogitsProcessor):
    """Sampling at a temperature and top-p by the Gumbel-max trick, with one generator per row.

    argmax(scores + Gumbel noise) is a draw from softmax(scores), so `generate` runs greedy
    and each row's noise comes from its own seeded generator. `logprobs` holds, per step, the
    log-prob of the token each row drew under the scores it was drawn from; `warped`, only with
    `keep_scores`, each step's scores before the noise (for the branch cut's entropy).
    """

    def __init__(
        self, temperature: float, top_p: float, seeds: Sequence[int], keep_scores: bool = False
    ) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.seeds = list(seeds)
        self.keep_scores = keep_scores
        self.generators: list[torch.Generator] = []
        self.warped: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.seeds) != scores.shape[0]:
            raise ValueError(f"{len(self.seeds)} seeds for {scores.shape[0]} rows")
        scores = policy_scores(scores, self.temperature, self.top_p)
        if self.keep_scores:
            self.warped.append(scores)
        if not self.generators:  # on the logits' device: a GPU draws its own noise
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device)
                               for g in self.generators])  # fmt: skip
        noisy = scores - torch.log(-torch.log(uniform.clamp(min=1e-20)))
        drawn = noisy.argmax(-1, keepdim=True)  # what greedy `generate` takes
        self.logprobs.append(scores.log_softmax(-1).gather(-1, drawn).squeeze(-1))
        return noisy


class Sampled(NamedTuple):
    """`generate`'s continuations and, per token, the sampler's log-prob of it."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    """Under the scores the token was drawn from (`policy_scores`); NaN when decoding greedy."""
    routing: list[torch.Tensor] | None = None
    """For an MoE policy asked to record it, per row: (tokens, MoE layers, top_k), the experts
    the position whose logits drew each token chose (`RoutingRecorder`)."""


class RoutingRecorder:
    """Forward hooks on an MoE policy's routers while it generates: per forward call, the
    experts that each row's last position chose in each MoE layer. The prefill's last position
    is the prompt's last token and each later call's the token just drawn, so call t holds the
    routing of the position whose logits drew token t: the same position the trainer's forward
    scores it at (`grpo.steps.token_logprobs`), which the routing-flip share compares.

    The routers are the modules transformers records router logits from (the model class's
    `_can_record_outputs`): asking `generate` for `output_router_logits` instead makes Mixtral
    compute its aux loss at every decoding step, where the attention mask no longer matches
    the one token's logits, and fail. Under expert parallelism AutoEP's routers replace them,
    and return the experts they chose rather than logits: those are recorded as they are."""

    def __init__(self, model: torch.nn.Module, routing: Routing, rows: int) -> None:
        self.routing, self.rows, self.biases = routing, rows, None
        self.routers = autoep.routers(model)
        self.chose = bool(self.routers)
        if self.chose:
            self.index = autoep.CHOSEN
        else:
            recorded = model._can_record_outputs["router_logits"]
            self.routers = [m for m in model.modules() if isinstance(m, recorded.target_class)]
            self.index = recorded.index
            self.biases = router_biases(model) if routing.bias_rate is not None else None
        self.layers: list[torch.Tensor] = []
        self.calls: list[torch.Tensor] = []

    def __call__(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.layers.append(output[self.index] if isinstance(output, tuple) else output)
        if len(self.layers) == len(self.routers):  # the forward's last MoE layer
            if self.chose:
                chosen = routed_by_position(self.layers, self.rows, self.routing.top_k)
            else:
                chosen = chosen_by_position(self.layers, self.rows, self.routing, self.biases)
            self.calls.append(chosen[:, -1].to(torch.int16).cpu())
            self.layers = []

    @contextmanager
    def attached(self) -> Iterator[None]:
        hooks = [router.register_forward_hook(self) for router in self.routers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def generate(
    model: PreTrainedModel,
    sequences: Sequence[list[int]],
    n: int,
    max_new_tokens: int,
    generation: dict,
    *,
    branch_entropy: float = 0.0,
    cache: Cache | None = None,
    seeds: Sequence[int] = (),
    routing: Routing | None = None,
) -> Sampled:
    """n continuations of each sequence, in sequence order, each cut by `cut` and, when
    `branch_entropy` > 0, by `branch_cut`, with the sampler's log-prob of each token. `cache`,
    if given, holds every row's keys and values of all its tokens but the last, left-padded
    like the rows (`PrefixCache`). When `generation` samples, `seeds` has one generator seed
    per continuation, in the same order. With `routing` (an MoE policy's), the experts each
    drawn token's position chose too."""
    pad = generation["pad_token_id"]
    ids, mask, _ = left_padded(sequences, pad)
    width = ids.shape[1]
    extra = {} if cache is None else {cache_argument(model): cache}
    generation = dict(generation)
    sampler = None
    if "temperature" in generation:
        if len(seeds) != len(sequences) * n:
            raise ValueError(f"{len(seeds)} seeds for {len(sequences) * n} continuations")
        sampler = RowSampler(generation.pop("temperature"), generation.pop("top_p"), seeds,
                             keep_scores=bool(branch_entropy))  # fmt: skip
        extra["logits_processor"] = LogitsProcessorList([sampler])
    if branch_entropy:
        extra |= {"return_dict_in_generate": True, "output_scores": True}
    recorder = None if routing is None else RoutingRecorder(model, routing, len(sequences) * n)
    with recorder.attached() if recorder else nullcontext():
        out = _generate(model, ids, mask, n, max_new_tokens, generation, extra)
    tokens = out.sequences if branch_entropy else out
    rows = [cut(row, generation["eos_token_id"], pad) for row in tokens[:, width:].tolist()]
    if branch_entropy:
        rows = branch_cut(rows, sampler.warped if sampler else out.scores, branch_entropy)
    routed = None
    if recorder is not None:
        calls = torch.stack(recorder.calls, 1)  # [rows, calls, layers, top_k]
        routed = [calls[i, : len(row)] for i, row in enumerate(rows)]
    if sampler is None or not sampler.logprobs:
        return Sampled(rows, [[float("nan")] * len(row) for row in rows], routed)
    drawn = torch.stack(sampler.logprobs, 1).tolist()  # [rows, steps]
    return Sampled(rows, [lp[: len(row)] for row, lp in zip(rows, drawn, strict=True)], routed)


def _generate(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    n: int,
    max_new_tokens: int,
    generation: dict,
    extra: dict,
) -> torch.Tensor:
    """`model.generate` on the left-padded rows, each repeated n times, greedy on the processed
    scores (the sampler's noise is in them)."""
    device = next(model.parameters()).device
    return model.generate(
        # Rows repeated here, as num_return_sequences would (greedy refuses it), so n = B works greedy.
        input_ids=ids.repeat_interleave(n, 0).to(device), attention_mask=mask.repeat_interleave(n, 0).to(device),
        max_new_tokens=max_new_tokens, use_cache=True, do_sample=False, **generation, **extra,
        # Gathered (training.engine.gathered), each rank generates alone: transformers would
        # otherwise keep ranks in lockstep under ZeRO-3, which deadlocks when ranks make
        # different numbers of generate calls (tree search). Per-token gathering and expert
        # parallelism need lockstep.
        synced_gpus=in_lockstep(model),
    )  # fmt: skip


def cut(tokens: list[int], eos_id: int, pad_id: int) -> list[int]:
    """A sampled row's tokens up to and including the first eos, without padding."""
    out = []
    for token in tokens:
        if token == pad_id and token != eos_id:
            break
        out.append(token)
        if token == eos_id:
            break
    return out


def branch_cut(
    rows: list[list[int]], scores: Sequence[torch.Tensor], threshold: float
) -> list[list[int]]:
    """Each row up to its first token, after the first, drawn from a distribution whose
    entropy exceeds `threshold` nats: the tree branches there (TreeRL, ARPO). `scores` are
    `generate`'s processed logits per step (temperature and top-p applied: the entropy of what
    was sampled from, `RowSampler.warped`)."""
    logp = torch.stack([s.float() for s in scores], 1).log_softmax(-1)  # [rows, steps, vocab]
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    out = []
    for row, h in zip(rows, entropy.tolist(), strict=True):
        uncertain = [i for i in range(1, len(row)) if h[i] > threshold]
        out.append(row[: uncertain[0]] if uncertain else row)
    return out
