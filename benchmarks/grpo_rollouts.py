"""Benchmark: tree rollouts against flat sampling at the same generated-token budget.

    python benchmarks/grpo_rollouts.py [--run results/tiny] [--prompts 64] [--steps 40]

Needs a consolidated model of the default run (`snakemake --cores all` makes it).

1. Rollouts, side by side on the same prompts and the same policy: flat
   samples `group_size` completions per prompt; the tree search gets, per
   prompt, the tokens flat sampling generated for it as its budget (and no leaf
   limit). Prints scored leaves per 1000 generated tokens of each, their ratio,
   and the mean reward of the leaves. Prompts are level-1 and level-2 problems
   of the default families, as the curriculum draws them.
2. Training: the GRPO stage on two CPU ranks from that model, once flat and
   once tree, the same steps, prompts per step, leaves per prompt and seed
   (the default config's grpo section otherwise, its tree shape for the tree
   run); prints the held-out accuracy before and after each and the tokens
   each generated.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagetrain import config as stconfig
from stagetrain.grpo.rollouts import flat_groups, tree_groups
from stagetrain.grpo.tree import TreeConfig
from stagetrain.tasks import sample, score
from stagetrain.training.evaluation import prompt_ids

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def rollouts(folder: Path, grpo: dict, prompts: int, seed: int) -> None:
    """Part 1: leaves per 1000 generated tokens, flat against tree, same prompts and budget."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(seed)
    families = grpo["curriculum"]["families"]
    batch = [sample(rng.choice(families), rng.choice([1, 2]), "train", rng) for _ in range(prompts)]
    ids = [prompt_ids(tok, p, grpo["max_prompt_len"]) for p in batch]
    common = {
        "temperature": grpo["temperature"],
        "top_p": grpo["top_p"],
        "pad_id": tok.pad_token_id,
    }

    def reward(i: int, completion: list[int], offset: int = 0) -> float:
        return score(tok.decode(completion, skip_special_tokens=False), batch[offset + i])

    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        flat = flat_groups(model, ids, reward, group_size=grpo["group_size"],
                           max_new_tokens=grpo["max_new_tokens"], eos_id=tok.eos_token_id,
                           max_batch=len(ids) * grpo["group_size"], **common)  # fmt: skip
    flat_s = time.perf_counter() - start
    rows = [("flat", flat, flat_s)]
    for b, k in ((2, 1), (2, 4), (4, 4), (2, 8)):
        trees, seconds = [], 0.0
        for i, (prompt, group) in enumerate(zip(ids, flat, strict=True)):
            cfg = TreeConfig(branching=b, segment_tokens=k, max_leaves=10**6,
                             max_tokens=max(1, group.generated_tokens), max_new_tokens=grpo["max_new_tokens"],
                             uct_c=grpo["tree"]["uct_c"], eos_id=tok.eos_token_id)  # fmt: skip
            start = time.perf_counter()
            with torch.no_grad():
                trees += tree_groups(
                    model, [prompt], lambda j, c, i=i: reward(j, c, i), cfg, **common
                )
            seconds += time.perf_counter() - start
        rows.append((f"tree B={b} K={k}", trees, seconds))
    base = None
    print(
        f"{prompts} prompts; flat: {grpo['group_size']} samples each; tree: flat's tokens for the prompt as budget"
    )
    print(
        f"{'rollout':<14} {'leaves':>7} {'tokens':>7} {'leaves/1k tok':>14} {'ratio':>6} {'mean reward':>12} {'tokens/s':>9}"
    )
    for name, groups, seconds in rows:
        leaves = sum(len(g.rewards) for g in groups)
        tokens = sum(g.generated_tokens for g in groups)
        per_k = 1000 * leaves / tokens
        base = base or per_k
        mean = sum(r for g in groups for r in g.rewards) / leaves
        print(f"{name:<14} {leaves:>7} {tokens:>7} {per_k:>14.1f} {per_k / base:>6.2f} {mean:>12.3f} {tokens / seconds:>9.0f}")  # fmt: skip


def training(folder: Path, run: Path, cfg: dict, steps: int) -> None:
    """Part 2: the GRPO stage, flat and tree, same steps, prompts and leaves per prompt."""
    import pretrain_harness as harness

    data = {key: str(run / rel) for key, rel in (("tokenizer", "tokenizer"), ("val", "data/val.bin"),
            ("meta", "data/meta.json"), ("model_config", "model_config.json"))}  # fmt: skip
    layout = {"dp": 2, "tp": 1, "zero_stage": 0}
    print(f"\nGRPO, {steps} steps from {folder} on 2 CPU ranks, {cfg['grpo']['prompts_per_step']} prompts x "
          f"{cfg['grpo']['group_size']} leaves per step")  # fmt: skip
    print(
        f"{'rollout':<8} {'accuracy start':>15} {'end':>6} {'gain':>6} {'generated tokens':>17} {'seconds':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for rollout in ("flat", "tree"):
            grpo = {
                **cfg["grpo"],
                "rollout": rollout,
                "steps": steps,
                "eval_every": steps,
                "checkpoint_every": steps,
            }
            local = {**cfg, "grpo": grpo, "parallelism": dict(cfg["parallelism"])}
            start = time.perf_counter()
            summary = harness.run_grpo(
                data, str(folder), Path(tmp) / rollout, world=2, layout=layout, cfg=local
            )
            seconds = time.perf_counter() - start
            records = [
                json.loads(line)
                for line in (Path(tmp) / rollout / "metrics.jsonl").read_text().splitlines()
            ]
            tokens = sum(
                r.get("rollout/generated_tokens", 0) for r in records
            )  # eval records have none
            acc = summary["accuracy"]
            print(f"{rollout:<8} {acc['start']:>15.3f} {acc['end']:>6.3f} {acc['end'] - acc['start']:>+6.3f} "
                  f"{tokens:>17,} {seconds:>8.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", default="results/tiny", help="the default run's results folder")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of part 1 (0: skip it)")
    parser.add_argument(
        "--steps", type=int, default=40, help="GRPO steps of each training run (0: skip part 2)"
    )
    args = parser.parse_args()
    run = Path(args.run).resolve()
    folder = run / "model" / "pretrain"
    if not (folder / "MANIFEST.json").exists():
        sys.exit(f"error: {folder}: no consolidated model; run `snakemake --cores all` first")
    cfg = stconfig.load(REPO / "config" / "config.yaml")
    if args.prompts:
        rollouts(folder, cfg["grpo"], args.prompts, cfg["run"]["seed"])
    if args.steps:
        training(folder, run, cfg, args.steps)


if __name__ == "__main__":
    main()
