"""Benchmark: where a GRPO step's time goes, against a bare loop doing the same work.

    python -m benchmarks.grpo_step [--spec results/tiny/checkpoints/grpo/job.json]
                                   [--steps 30] [--warmup 5] [--precision fp32|bf16]
                                   [--attention sdpa|eager]

Run from the repository root. Needs the GRPO job spec of a finished default run
(`snakemake --cores all grpo` writes it); its plan's ranks are started with torchrun, the
machine's cores shared out over them, as the stage starts them. The spec is copied with the steps cut to
warmup + steps and its checkpoints, metrics and plots sent to a scratch folder.

1. The stage's own loop (`grpo.train.setup` and `loop`), its functions wrapped by timers,
   exclusive of each other: prompt draw, generation, rewards, the reference's and other
   no-grad log-probs, each training forward, `engine.backward`, `engine.step`, the step's
   collectives (sums and the curriculum's gather), evaluation, checkpoint and metrics.
2. In the same ranks, the bare floor: transformers and torch only (no engine, no
   curriculum, no judge), doing the same work on the same tokens: one `generate` per step
   of the batch the stage sampled (same prompts, `group_size` rows each, same temperature
   and top-p, transformers' own sampler, as many tokens decoded as the stage's longest
   completion of the step on that rank, each prompt prefilled once as the stage's sampler
   does), the reference forward when `kl_coef` > 0, and
   one forward and backward of the policy per pass over the completions the stage trained
   on, with DDP's gradient all-reduce and torch's AdamW. Its forwards share each prompt as
   the stage's do (`grpo.shared_prompts`: two plain transformers forwards).

Prints each phase's seconds per step (the stage's steady steps, after the warmup; the
evaluation and checkpoint amortised at the config's cadence are shown apart), the bare
loop's, and `ratio` = stage step / bare step. The last line is a JSON object with them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stagetrain.grpo.run import Run
    from stagetrain.training.spec import GrpoJob

REPO = Path(__file__).resolve().parents[1]
PHASES = (
    ("draw", "prompt draw (curriculum, problems, prompt ids)"),
    ("generate", "generation (`generate`, the sampler)"),
    ("rewards", "rewards (the judge)"),
    ("no_grad", "no-grad log-probs (reference; old when passes > 1)"),
    ("forward", "training forwards (`token_logprobs` with grad)"),
    ("loss", "loss and its tensors (`grpo_loss`, rows, masks)"),
    ("backward", "`engine.backward` (with DeepSpeed's gradient all-reduce)"),
    ("optimizer", "`engine.step`"),
    ("collectives", "the step's scalar collectives and the rows' gather"),
    ("other", "the rest of the step (advantages, records, curriculum)"),
)
OWN_WORK = ("draw", "generate", "rewards", "no_grad", "forward", "loss", "optimizer", "other")
"""The phases in which a rank waits for no other (backward's all-reduce and the collectives do)."""
AMORTISED = (
    ("evaluation", "held-out evaluation"),
    ("checkpoint", "checkpoint"),
    ("metrics", "a metrics record"),
)


class Timers:
    """Exclusive wall-clock seconds per phase: time inside a nested timed call counts for the
    inner phase only, so the phases of one step add up to its time."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []
        self._names: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name != "evaluation" and "evaluation" in self._names:  # the evaluation's own work
            yield
            return
        self._stack.append([0.0])
        self._names.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            self._names.pop()
            inner = self._stack.pop()[0]
            self.total[name] += elapsed - inner
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][0] += elapsed

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed


def _instrument(timers: Timers, trained: list[list[tuple[list[int], list[int]]]]) -> None:
    """Wrap the stage's functions in place (module globals, so its own call sites time them);
    `trained` collects each step's (prompt, completion) pairs for the bare loop."""
    from stagetrain.grpo import prefix_cache, rollouts, steps, train
    from stagetrain.training import checkpoints

    def token_logprobs(*args: Any, **kwargs: Any) -> Any:
        name = "forward" if torch.is_grad_enabled() else "no_grad"
        with timers.phase(name):
            return original_logprobs(*args, **kwargs)

    original_logprobs = steps.token_logprobs
    steps.token_logprobs = token_logprobs
    original_train_on = steps.train_on

    def train_on(run: Any, groups: list[Any]) -> Any:
        trained.append([(g.prompt, c) for g in groups for c in g.completions])
        return original_train_on(run, groups)

    steps.train_on = train_on
    for module, name, phase in (
        (steps, "draw_problems", "draw"), (steps, "step_prompts", "draw"),
        (rollouts, "generate", "generate"), (prefix_cache.PrefixCache, "sample", "generate"),
        (steps, "grpo_loss", "loss"), (steps, "_token_rows", "loss"), (steps, "completion_mask", "loss"),
        (steps, "_dp_sums", "collectives"), (steps, "_dp_max", "collectives"), (steps, "gather_dp", "collectives"),
        (steps, "step", "other"), (train, "accuracy", "evaluation"), (train, "val_loss", "evaluation"),
    ):  # fmt: skip
        setattr(module, name, timers.wrap(phase, getattr(module, name)))
    checkpoints.Checkpoints.save = timers.wrap("checkpoint", checkpoints.Checkpoints.save)
    setup = train.setup

    def instrumented_setup(spec: GrpoJob) -> Run:
        run = setup(spec)
        run.engine.backward = timers.wrap("backward", run.engine.backward)
        run.engine.step = timers.wrap("optimizer", run.engine.step)
        run.judge.rewards = timers.wrap("rewards", run.judge.rewards)
        run.judge.prompt_ids = timers.wrap("draw", run.judge.prompt_ids)
        return run

    train.setup = instrumented_setup


@contextlib.contextmanager
def _whole_models() -> Iterator[None]:
    """Loading outside ZeRO-3: a stage run under ZeRO-3 registered its DeepSpeed config with
    transformers, whose `from_pretrained` would then build the bare loop's models partitioned.
    The registration is a module global of transformers' (no public way to set it aside)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def _bare_floor(
    run: Any, trained: list[list[tuple[list[int], list[int]]]], warmup: int
) -> tuple[float, dict[str, float]]:
    """Seconds per step of the bare loop over the stage's steady steps (module docstring, 2),
    and per phase."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM, DynamicCache

    # The stage's prompt sharing is two plain transformers forwards; the floor does that work too.
    from stagetrain.grpo.sampling import cache_argument, left_padded
    from stagetrain.grpo.shared_prompts import completion_logits

    cfg, spec, pad = run.cfg, run.spec, run.tokenizer.pad_token_id
    dtype, device = next(run.engine.module.parameters()).dtype, run.device
    kernel = run.engine.module.config._attn_implementation  # the stage's, from its plan
    with _whole_models():
        policy = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation=kernel)
        reference = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation=kernel)
    policy, reference = policy.to(device, dtype), reference.to(device, dtype).eval()
    reference.requires_grad_(False)
    ddp = DistributedDataParallel(policy, process_group=run.engine.data_parallel_group,
                                  device_ids=[device] if device.type == "cuda" else None)  # fmt: skip
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.optimizer.lr)

    timers = Timers()
    keyword, group = cache_argument(policy), cfg.group_size

    def one(items: list[tuple[list[int], list[int]]]) -> None:
        ids, mask, position = left_padded(
            list(dict.fromkeys(tuple(p) for p, _ in items)), pad, device
        )
        decoded = max(len(c) for _, c in items)  # the stage's call decoded as many tokens
        policy.eval()
        with torch.no_grad(), timers.phase("generate"):
            # Each prompt prefilled once (all but its last token), the cache repeated to its
            # group's rows, as the stage's sampler does.
            cache = DynamicCache()
            policy(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position[:, :-1],
                   use_cache=True, **{keyword: cache})  # fmt: skip
            cache = DynamicCache(ddp_cache_data=[(layer.keys.repeat_interleave(group, 0),
                                                  layer.values.repeat_interleave(group, 0)) for layer in cache.layers])  # fmt: skip
            policy.generate(input_ids=ids.repeat_interleave(group, 0), attention_mask=mask.repeat_interleave(group, 0),
                            max_new_tokens=decoded, min_new_tokens=decoded, do_sample=True, temperature=cfg.temperature,
                            top_p=cfg.top_p, pad_token_id=pad, eos_token_id=run.tokenizer.eos_token_id,
                            **{keyword: cache})  # fmt: skip
        policy.train()
        if cfg.kl_coef > 0:
            with torch.no_grad(), timers.phase("no_grad"):
                completion_logits(reference, items, device, pad)[0].float().log_softmax(-1)
        for _ in range(cfg.passes):
            with timers.phase("forward"):
                logits, tokens = completion_logits(ddp, items, device, pad)
                logp = logits.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                loss = -(logp * (tokens != pad)).sum() / (tokens != pad).sum()
            with timers.phase("backward"):
                loss.backward()
            with timers.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    for items in trained[:warmup]:
        one(items)
    dist.barrier()
    timers.total.clear()
    start = time.perf_counter()
    for items in trained[warmup:]:
        one(items)
    dist.barrier()
    n = max(len(trained) - warmup, 1)
    return (time.perf_counter() - start) / n, {k: v / n for k, v in timers.total.items()}


def rank(spec_path: str, warmup: int, out: str) -> None:
    """One rank: the stage's loop under the timers, then the bare loop (module docstring)."""
    import torch.distributed as dist

    from stagetrain.grpo import train
    from stagetrain.training.rank import rank_main

    timers, trained = Timers(), []
    _instrument(timers, trained)
    steady: dict[str, float] = {}
    marks: list[
        float
    ] = []  # this rank's own work (not waiting in a collective) at each step's start

    def body(spec: GrpoJob) -> None:
        run = train.setup(spec)
        original_steps = run.loop.steps

        def steps() -> Iterator[int]:
            if run.loop.metrics is not None:  # opened by the loop's resume, before the first step
                run.loop.metrics.write = timers.wrap("metrics", run.loop.metrics.write)
            for step in original_steps():
                if step == run.loop.start + warmup:
                    dist.barrier()
                    steady.update(timers.total, _start=time.perf_counter())
                if step >= run.loop.start + warmup:
                    marks.append(sum(timers.total[name] for name in OWN_WORK))
                yield step
            marks.append(sum(timers.total[name] for name in OWN_WORK))

        run.loop.steps = steps
        train.loop(run)
        dist.barrier()
        elapsed = time.perf_counter() - steady.pop("_start")
        n = len(trained) - warmup
        stage = {name: (timers.total[name] - steady.get(name, 0.0)) / n for name, _ in PHASES}
        once = {name: timers.total[name] / max(timers.calls[name], 1) for name, _ in AMORTISED}
        work = [b - a for a, b in itertools.pairwise(marks)]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, work)
        lead = sum(max(w) - sum(w) / len(w) for w in zip(*every, strict=True)) / n
        bare, bare_phases = _bare_floor(run, trained, warmup)
        if dist.get_rank() == 0:
            result = {"steps": n, "step_s": elapsed / n, "phases": stage, "once": once, "bare_step_s": bare, "bare_phases": bare_phases, "lead_s": lead,
                      "eval_every": run.cfg.eval_every, "log_every": run.cfg.log_every, "checkpoint_every": run.cfg.checkpoint_every,
                      "precision": run.layout.precision, "attention": run.engine.module.config._attn_implementation, "dp": run.layout.dp, "zero_stage": run.engine.zero_optimization_stage(), "warmup": warmup,
                      "tokens_per_step": sum(len(p) + len(c) for p, c in trained[-1]) * run.layout.dp}  # fmt: skip
            Path(out).write_text(json.dumps(result))

    rank_main(body, ["--spec", spec_path])


def _job(
    spec_path: Path, scratch: Path, steps: int, precision: str | None, attention: str | None,
    zero: int | None = None, gather: str | None = None, partition_all: bool = False,
) -> Path:  # fmt: skip
    """A copy of the stage's job spec: `steps` steps, every output in `scratch`, and its plan
    and DeepSpeed config copied too, in `precision`, with `attention`, at ZeRO stage `zero` and
    ZeRO-3's generation `gather` where given; `partition_all`: every parameter partitioned."""
    from stagetrain.io import read_json

    spec: GrpoJob = read_json(spec_path)
    for key in ("summary", "metrics", "reward_plot", "completions", "completions_table"):
        spec[key] = str(scratch / Path(spec[key]).name)
    spec["checkpoints"], spec["tensorboard"] = (
        str(scratch / "checkpoints"),
        str(scratch / "tensorboard"),
    )
    spec["grpo"] = {**spec["grpo"], "steps": steps}
    ds, plan = read_json(spec["deepspeed_config"]), read_json(spec["plan"])
    if precision:
        for key in ("bf16", "fp16"):
            ds.pop(key, None)
        if precision == "bf16":
            ds["bf16"] = {"enabled": True}
        plan["stages"]["grpo"]["layout"]["precision"] = precision
    if attention:
        plan["attention"] = attention
    if zero is not None:
        ds["zero_optimization"] = {**ds["zero_optimization"], "stage": zero}
        plan["stages"]["grpo"]["layout"]["zero_stage"] = zero
    if gather is not None:
        plan["stages"]["grpo"]["generation"]["gather"] = gather
    if partition_all:  # DeepSpeed keeps parameters under 1e5 elements whole: all of a tiny model's
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    for name, doc in (("deepspeed_config", ds), ("plan", plan)):
        (scratch / f"{name}.json").write_text(json.dumps(doc))
        spec[name] = str(scratch / f"{name}.json")
    path = scratch / "job.json"
    path.write_text(json.dumps(spec))
    return path


def table(result: dict[str, Any]) -> str:
    """The phase table and the ratio against the bare loop."""
    step = result["step_s"]
    bare = result["bare_phases"]
    lines = [
        "| phase | stage, s per step | share | bare loop, s per step |",
        "| --- | --- | --- | --- |",
    ]
    for name, label in PHASES:
        s = result["phases"][name]
        floor = f"{bare[name]:.4f}" if name in bare else ""
        lines.append(f"| {label} | {s:.4f} | {s / step:.0%} | {floor} |")
    lines.append(f"| **a steady step** | **{step:.4f}** | | **{result['bare_step_s']:.4f}** |")
    lines.append(
        f"| of the step: the slowest rank's lead in its own work (waited for in backward and the "
        f"collectives) | {result['lead_s']:.4f} | {result['lead_s'] / step:.0%} | |"
    )
    for name, label in AMORTISED:
        once = result["once"][name]
        every = result[
            {"checkpoint": "checkpoint_every", "evaluation": "eval_every", "metrics": "log_every"}[
                name
            ]
        ]
        lines.append(
            f"| {label}: {once:.3f} s each, every {every} steps | {once / every:.4f} | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--spec", type=Path, default=REPO / "results/tiny/checkpoints/grpo/job.json"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="instead of the plan's")
    parser.add_argument("--attention", choices=("sdpa", "eager"), help="instead of the plan's")
    parser.add_argument(
        "--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage, instead of the plan's"
    )
    parser.add_argument(
        "--gather",
        choices=("whole", "per_token"),
        help="ZeRO-3's generation gathering, instead of the plan's",
    )
    parser.add_argument(
        "--partition-all",
        action="store_true",
        help="ZeRO-3 partitions every parameter (DeepSpeed keeps those under 1e5 elements whole)",
    )
    parser.add_argument("--rank", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank(args.rank[0], args.warmup, args.rank[1])
        return
    if not args.spec.is_file():
        sys.exit(f"{args.spec}: no GRPO job spec; run `snakemake --cores all grpo` first")
    from stagetrain.io import read_json
    from stagetrain.training.launch import rank_environment, torchrun_command

    with tempfile.TemporaryDirectory() as tmp:
        job = _job(args.spec, Path(tmp), args.warmup + args.steps, args.precision, args.attention,
                   args.zero, args.gather, args.partition_all)  # fmt: skip
        world = read_json(read_json(job)["plan"])["world"]
        out = Path(tmp) / "result.json"
        cmd = torchrun_command(nodes=1, procs_per_node=world, module="benchmarks.grpo_step",
                               args=["--warmup", str(args.warmup), "--rank", str(job), str(out)],
                               allocation=None)  # fmt: skip
        env = rank_environment(os.environ, cores=os.cpu_count() or 1, ranks_per_node=world)
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode or not out.is_file():
            sys.exit(
                f"the benchmark's ranks failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        result = json.loads(out.read_text())
    result["ratio"] = result["step_s"] / result["bare_step_s"]
    print(f"{result['precision']}, {result['attention']} attention, dp {result['dp']}, ZeRO-{result['zero_stage']}, "
          f"{result['tokens_per_step']} tokens trained per step, "
          f"{result['steps']} steady steps")  # fmt: skip
    print(table(result))
    print(f"ratio (stage step / bare step): {result['ratio']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
