"""Benchmark: tree rollouts against flat sampling at the same generated-token budget.

    python -m benchmarks.grpo_rollouts [--run results/tiny] [--prompts 64] [--levels 2,3]
                                       [--curve] [--steps 40] [--tree-steps N] [--seeds 3]

Run from the repository root (it imports tests.harness). Needs a consolidated model of the
default run (`snakemake --cores all pretrain` makes it).

1. Rollouts, side by side on the same prompts and the same policy: flat
   samples `group_size` completions per prompt; the tree search gets, per
   prompt, the tokens flat sampling generated for it as its budget (and no leaf
   limit). Both generate at most the plan's GRPO generation batch of sequences
   per `generate` call; the trees of all prompts grow together, one call per
   round for the nodes every tree selected. Prints scored leaves per 1000
   generated tokens, wall-clock and CPU seconds per scored leaf (one torch
   thread; CPU seconds suffer less from other users' load), the mean reward of the leaves and
   the share of prompts whose leaves all got the same reward, each against flat.
   Prompts are drawn at `--levels` of the default families (2 and 3: worked
   solutions of 16-26 tokens).
2. Training: the GRPO stage on two CPU ranks from that model, flat and tree,
   `--seeds` seeds each, at the same generated-token budget: flat runs `--steps`
   steps, the tree the steps that spend flat's tokens at part 1's tokens per leaf
   (its groups are group_size leaves), or `--tree-steps`. The default config's grpo section
   otherwise. Prints the held-out accuracy gain of each run, and the mean gain of
   each mode with its standard error.
--curve: part 1 for the config's tree shape at each level alone, against the
   completions' length (where the tree starts to pay).

Last line: one JSON object with the targets' numbers (`leaves_per_1k_ratio`,
`seconds_per_leaf_ratio`, `cpu_seconds_per_leaf_ratio` of the config's tree shape; `gain_tree`, `gain_flat`,
`gain_se` of part 2), null where a part was skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagetrain.config import validation as stconfig
from stagetrain.grpo.rollouts import Group, flat_groups, tree_groups
from stagetrain.grpo.tree import TreeConfig
from stagetrain.io import read_json
from stagetrain.tasks import sample, score
from stagetrain.tasks.prompts import Prompter

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((2, 4), (2, 8), (4, 8), (2, 16))
"""(B, K) tree shapes of part 1; the config's own shape is added."""
PROBES = (2, 4)
"""probe_leaves of part 1's probe rows (the config's shape)."""
ENTROPY = ((4, 0.5), (4, 1.0), (8, 0.5), (8, 1.0))
"""(longest segment K, branch_entropy in nats) of part 1's entropy-branching rows."""


def _summary(groups: list[Group], seconds: float, cpu: float, fed: int) -> dict[str, float]:
    """Counts and rates of one rollout mode; `cpu` is the process's CPU seconds (one torch thread),
    which other users' load on a shared machine inflates much less than wall-clock seconds; `fed`
    the token positions the model computed (prefill and decode, padding included)."""
    leaves = sum(len(g.rewards) for g in groups)
    tokens = sum(g.generated_tokens for g in groups)
    return {
        "leaves": leaves, "tokens": tokens, "per_1k": 1000 * leaves / tokens, "seconds": seconds,
        "s_per_leaf": seconds / leaves, "cpu_per_leaf": cpu / leaves, "reward": sum(r for g in groups for r in g.rewards) / leaves,
        "zero_std": sum(not g.varies for g in groups) / len(groups), "length": sum(g.flat_tokens for g in groups) / leaves,
        "fed": fed, "useful_per_1k": 1000 * sum(len(g.rewards) for g in groups if g.varies) / tokens,
    }  # fmt: skip


class _Fed:
    """Counts the token positions the model is fed (a forward pre-hook on its base model)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.count = 0
        self.handle = model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, _args, kwargs) -> None:  # noqa: ANN001
        self.count += kwargs["input_ids"].numel()

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _variants(
    shapes, own: tuple[int, int], variants: bool
) -> list[tuple[str, tuple[int, int], dict]]:  # noqa: ANN001
    """(row name, (B, K), tree_groups and TreeConfig changes) of each tree run: the shapes with
    the prefix cache, then (`variants`) the config's shape without it, with a probe against
    zero-variance groups and with entropy branching (K the longest segment)."""
    rows = [
        (f"tree B={b} K={k}" + (" (config)" if (b, k) == own else ""), (b, k), {})
        for b, k in shapes
    ]
    if not variants:
        return rows
    b, k = own
    rows.append((f"tree B={b} K={k} no prefix cache", own, {"prefix_cache": False}))
    rows += [(f"tree B={b} K={k} probe {p}", own, {"probe_leaves": p}) for p in PROBES]
    rows += [
        (f"tree B={b} K={kk} entropy {h}", (b, kk), {"branch_entropy": h}) for kk, h in ENTROPY
    ]
    return rows


def _compare(
    model, tok, grpo: dict, problems: list, seed: int, batch: int, shapes, variants: bool = False
) -> tuple[dict, list[Group]]:  # noqa: ANN001
    """Flat sampling, then each tree shape with flat's tokens per prompt as its budget."""
    prompter = Prompter(tok, chat_template=False, limit=grpo["max_prompt_len"])
    ids = [prompter.ids(p) for p in problems]
    common = {
        "keys": [(seed, i) for i in range(len(ids))],
        "temperature": grpo["temperature"],
        "top_p": grpo["top_p"],
        "pad_id": tok.pad_token_id,
    }
    own = (grpo["tree"]["branching"], grpo["tree"]["segment_tokens"])

    def reward(i: int, completion: list[int]) -> float:
        return score(tok.decode(completion, skip_special_tokens=False), problems[i])

    fed = _Fed(model)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        flat = flat_groups(
            model,
            ids,
            reward,
            group_size=grpo["group_size"],
            max_new_tokens=grpo["max_new_tokens"],
            eos_id=tok.eos_token_id,
            max_batch=batch,
            **common,
        )
    rows = {
        "flat": _summary(flat, time.perf_counter() - start, time.process_time() - cpu, fed.take())
    }

    for name, (b, k), extra in _variants(shapes, own, variants):
        cfg = TreeConfig(
            branching=b,
            segment_tokens=k,
            max_leaves=10**6,
            max_tokens=1,
            max_new_tokens=grpo["max_new_tokens"],
            uct_c=grpo["tree"]["uct_c"],
            eos_id=tok.eos_token_id,
            probe_leaves=extra.get("probe_leaves", 0),
            branch_entropy=extra.get("branch_entropy", 0.0),
            prefix_cache=extra.get("prefix_cache", True),
        )
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            trees = tree_groups(
                model,
                ids,
                reward,
                cfg,
                max_batch=batch,
                budgets=[g.generated_tokens for g in flat],
                **common,
            )
        rows[name] = _summary(
            trees, time.perf_counter() - start, time.process_time() - cpu, fed.take()
        )
    fed.handle.remove()
    return rows, flat  # fmt: skip


def _flat_probe(groups: list[Group], probe: int) -> dict[str, float]:
    """Flat sampling that draws `probe` completions first and the rest of the group only if
    their rewards differ, computed exactly from flat's samples (they are independent draws);
    it has no time of its own."""
    kept = [(g.rewards, g.completions) if g.varies or len(set(g.rewards[:probe])) > 1
            else (g.rewards[:probe], g.completions[:probe]) for g in groups]  # fmt: skip
    leaves = sum(len(r) for r, _ in kept)
    tokens = sum(len(c) for _, cs in kept for c in cs)
    nan = float("nan")
    return {
        "leaves": leaves, "tokens": tokens, "per_1k": 1000 * leaves / tokens, "seconds": nan, "s_per_leaf": nan,
        "cpu_per_leaf": nan, "reward": sum(sum(r) for r, _ in kept) / leaves, "fed": 0,
        "zero_std": sum(len(set(r)) == 1 for r, _ in kept) / len(kept), "length": tokens / leaves,
        "useful_per_1k": 1000 * sum(len(r) for r, _ in kept if len(set(r)) > 1) / tokens,
    }  # fmt: skip


def _ratios(rows: dict) -> dict:
    base, mine = rows["flat"], next(r for name, r in rows.items() if name.endswith("(config)"))
    return {
        "leaves_per_1k_ratio": mine["per_1k"] / base["per_1k"],
        "seconds_per_leaf_ratio": mine["s_per_leaf"] / base["s_per_leaf"],
        "cpu_seconds_per_leaf_ratio": mine["cpu_per_leaf"] / base["cpu_per_leaf"],
        "tokens_per_leaf_ratio": (mine["tokens"] / mine["leaves"]) / (base["tokens"] / base["leaves"]),
    }  # fmt: skip


def _load(folder: Path):  # noqa: ANN202
    torch.set_num_threads(1)  # a shared 2-core machine: threads that wait on each other add noise
    tok = AutoTokenizer.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), tok


def rollouts(
    folder: Path, grpo: dict, prompts: int, levels: list[int], seed: int, batch: int
) -> dict:
    """Part 1: leaves per 1000 generated tokens and seconds per leaf, tree shapes against flat."""
    model, tok = _load(folder)
    rng = random.Random(seed)
    families = grpo["curriculum"]["families"]
    problems = [
        sample(rng.choice(families), rng.choice(levels), "train", rng) for _ in range(prompts)
    ]
    own = (grpo["tree"]["branching"], grpo["tree"]["segment_tokens"])
    rows, flat = _compare(
        model, tok, grpo, problems, seed, batch, sorted({*SHAPES, own}), variants=True
    )
    for p in PROBES:
        rows[f"flat probe {p} (from flat's samples)"] = _flat_probe(flat, p)
    base = rows["flat"]
    print(
        f"{prompts} prompts at levels {levels} of {families}; flat: {grpo['group_size']} samples each; "
        f"tree: flat's tokens for the prompt as budget; at most {batch} sequences per generate call"
    )
    print(
        "| rollout | leaves | tokens | leaves/1k tok | ratio | s/leaf (ms) | ratio | CPU s/leaf (ms) | ratio | mean reward | zero-std prompts | leaf length | positions fed | leaves of varying groups/1k tok |"
    )
    print("| --- " * 14 + "|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['leaves']} | {r['tokens']:,} | {r['per_1k']:.1f} | {r['per_1k'] / base['per_1k']:.2f} | "
            f"{1000 * r['s_per_leaf']:.2f} | {r['s_per_leaf'] / base['s_per_leaf']:.2f} | "
            f"{1000 * r['cpu_per_leaf']:.2f} | {r['cpu_per_leaf'] / base['cpu_per_leaf']:.2f} | {r['reward']:.3f} | "
            f"{r['zero_std']:.2f} | {r['length']:.1f} | {r['fed']:,} | {r['useful_per_1k']:.1f} |"
        )
    return _ratios(rows)  # fmt: skip


def curve(folder: Path, grpo: dict, prompts: int, seed: int, batch: int) -> None:
    """The tree's advantage against completion length: the config's shape at each level alone."""
    model, tok = _load(folder)
    own = (grpo["tree"]["branching"], grpo["tree"]["segment_tokens"])
    families = grpo["curriculum"]["families"]
    print(f"\nTree B={own[0]} K={own[1]} against flat, {prompts} prompts per level of {families}")
    print(
        "| level | flat leaf length | leaves/1k ratio | s/leaf ratio | zero-std flat | zero-std tree |"
    )
    print("| --- " * 6 + "|")
    for level in range(1, 6):
        rng = random.Random(seed + level)
        problems = [sample(rng.choice(families), level, "train", rng) for _ in range(prompts)]
        rows, _ = _compare(model, tok, grpo, problems, seed, batch, [own])
        r, tree = _ratios(rows), rows[next(n for n in rows if n != "flat")]
        print(f"| {level} | {rows['flat']['length']:.1f} | {r['leaves_per_1k_ratio']:.2f} | "
              f"{r['seconds_per_leaf_ratio']:.2f} | {rows['flat']['zero_std']:.2f} | {tree['zero_std']:.2f} |", flush=True)  # fmt: skip


def _grpo_run(
    data: dict, folder: Path, out: Path, cfg: dict, rollout: str, steps: int, seed: int
) -> tuple[float, int, float]:
    """One GRPO run on two CPU ranks: (held-out accuracy gain, generated tokens, mean share of
    prompts per step whose rewards did not vary)."""
    from tests.harness import training as harness

    grpo = {
        **cfg["grpo"],
        "rollout": rollout,
        "steps": steps,
        "eval_every": steps,
        "checkpoint_every": steps,
    }
    local = {
        **cfg,
        "grpo": grpo,
        "parallelism": dict(cfg["parallelism"]),
        "run": {**cfg["run"], "seed": seed},
    }
    layout = {"dp": 2, "tp": 1, "zero_stage": 0}
    summary = harness.run_grpo(data, str(folder), out, world=2, layout=layout, cfg=local)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r.get("rollout/generated_tokens", 0) for r in records)  # eval records have none
    zero = statistics.fmean(
        r["frac_reward_zero_std"] for r in records if "frac_reward_zero_std" in r
    )
    return summary["accuracy"]["end"] - summary["accuracy"]["start"], tokens, zero


def training(folder: Path, run: Path, cfg: dict, steps: int, seeds: int, tree_steps: int) -> dict:
    """Part 2: GRPO flat and tree, `seeds` seeds each, at flat's generated-token budget."""
    data = {key: str(run / rel) for key, rel in (("tokenizer", "tokenizer"), ("val", "data/val.bin"),
            ("meta", "data/meta.json"), ("model_config", "model_config.json"))}  # fmt: skip
    print(f"\nGRPO from {folder} on 2 CPU ranks, {cfg['grpo']['prompts_per_step']} prompts x {cfg['grpo']['group_size']} "
          f"leaves per step; flat {steps} steps, tree {tree_steps} steps (to spend flat's generated tokens)")  # fmt: skip
    print(
        "| rollout | seed | steps | gain | generated tokens | zero-std groups | seconds |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    gains: dict[str, list[float]] = {"flat": [], "tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(cfg["run"]["seed"], cfg["run"]["seed"] + seeds):
            for rollout, n in (("flat", steps), ("tree", tree_steps)):
                start = time.perf_counter()
                gain, tokens, zero = _grpo_run(
                    data, folder, Path(tmp) / f"{rollout}{seed}", cfg, rollout, n, seed
                )
                gains[rollout].append(gain)
                print(f"| {rollout} | {seed} | {n} | {gain:+.3f} | {tokens:,} | {zero:.2f} | {time.perf_counter() - start:.0f} |", flush=True)  # fmt: skip
    out = {f"gain_{mode}": statistics.fmean(g) for mode, g in gains.items()}
    out["gain_se"] = {
        mode: statistics.stdev(g) / math.sqrt(len(g)) if len(g) > 1 else None
        for mode, g in gains.items()
    }
    print(
        f"mean gain: flat {out['gain_flat']:+.3f}, tree {out['gain_tree']:+.3f}; standard errors {out['gain_se']}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", default="results/tiny", help="the default run's results folder")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of part 1 (0: skip it)")
    parser.add_argument(
        "--levels", default="2,3", help="curriculum levels of part 1's prompts, comma-separated"
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="flat GRPO steps of part 2 (0: skip it)"
    )
    parser.add_argument(
        "--curve", action="store_true", help="also part 1 at each level alone (advantage by length)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds of each rollout mode in part 2")
    parser.add_argument(
        "--tree-steps",
        type=int,
        default=0,
        help="tree GRPO steps of part 2 (0: from part 1's tokens per leaf)",
    )
    args = parser.parse_args()
    run = Path(args.run).resolve()
    folder = run / "model" / "pretrain"
    if not (folder / "MANIFEST.json").exists():
        sys.exit(
            f"error: {folder}: no consolidated model; run `snakemake --cores all pretrain` first"
        )
    cfg = stconfig.load(REPO / "config" / "config.yaml")
    batch = read_json(run / "plan.json")["stages"]["grpo"]["generation"]["batch"]
    result = {
        "leaves_per_1k_ratio": None,
        "seconds_per_leaf_ratio": None,
        "cpu_seconds_per_leaf_ratio": None,
        "tokens_per_leaf_ratio": None,
    }
    if args.prompts:
        levels = [int(level) for level in args.levels.split(",")]
        result |= rollouts(folder, cfg["grpo"], args.prompts, levels, cfg["run"]["seed"], batch)
    if args.curve:
        curve(folder, cfg["grpo"], args.prompts or 32, cfg["run"]["seed"], batch)
    result |= {"gain_tree": None, "gain_flat": None, "gain_se": None}
    if args.steps:
        ratio = result["tokens_per_leaf_ratio"] or 1.0
        tree_steps = args.tree_steps or max(1, round(args.steps / ratio))
        result |= training(folder, run, cfg, args.steps, args.seeds, tree_steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
