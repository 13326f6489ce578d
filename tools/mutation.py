"""Mutation testing (mutmut) over the modules that are pure functions, with a score per module.

    python tools/mutation.py grpo/advantages          # one module: killed / survived / score
    python tools/mutation.py grpo/loss --show         # and the diff of every surviving mutant
    python tools/mutation.py --all                    # every module of MODULES, then a table
    python tools/mutation.py --list                   # the modules and the tests mapped to each

tools/mutants.py is the hand-written list of named guarantees; this is the tool that makes
every mutant of a module (mutmut's operators: numbers, comparisons, boolean operators,
arguments, strings, ...) and counts how many the module's own fast tests kill.

Each run copies the working tree (tracked and untracked files that git does not ignore) into
.mutation/<module>/ (git-ignored), writes mutmut's configuration into that copy's
pyproject.toml (only the module's file is mutated; only its mapped test files run, fast tier
only, in one process), and runs `mutmut run` there, so the working tree itself is never
touched. mutmut runs the mapped tests once to learn which tests call each function, then runs
for every mutant only those tests. A mutant is killed when they fail (or time out); it
survives when they pass, or when no test calls its function ("no tests").

Every surviving mutant is triaged: either a test in the module's test file kills it, or it is
equivalent (no input can tell it from the original) and goes into EQUIVALENT with the reason.
The score is killed / (mutants - equivalent). An EQUIVALENT entry that matches no surviving
mutant is reported stale. Scores and run times: docs/development.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mutants  # this folder's: python tools/mutation.py puts it first on the path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"
"""The copies mutmut runs in, one per module (git-ignored)."""

GOAL = 85.0
"""The least score (%) each module should keep."""

MODULES: dict[str, tuple[str, ...]] = {
    "grpo/advantages": ("tests/test_grpo_math.py", "tests/test_properties.py"),
    "grpo/loss": ("tests/test_grpo_math.py", "tests/test_properties.py"),
    "grpo/curriculum": ("tests/test_grpo_math.py", "tests/test_grpo_tasks.py", "tests/test_properties.py"),
    "grpo/tree": ("tests/test_grpo_tree.py", "tests/test_grpo_prefix_cache.py"),
    "grpo/completions": ("tests/test_grpo_completions.py",),
    "planning/memory": ("tests/test_planning.py", "tests/test_properties.py"),
    "planning/plan": ("tests/test_planning.py", "tests/test_training_layout.py", "tests/test_config.py"),
    "planning/search": ("tests/test_planning.py", "tests/test_table.py"),
    "planning/derived": ("tests/test_planning.py", "tests/test_inputs.py"),
    "training/checkpoints": (
        "tests/test_checkpoint_integrity.py", "tests/test_pretrain_unit.py", "tests/test_reshard.py",
    ),
    "training/integrity": ("tests/test_checkpoint_integrity.py", "tests/test_properties.py"),
    "training/batches": ("tests/test_pretrain_unit.py",),
    "tasks/verify": ("tests/test_tasks.py", "tests/test_task_families.py"),
    "tasks/arithmetic": ("tests/test_tasks.py",),
    "tasks/problem": ("tests/test_tasks.py", "tests/test_task_families.py"),
    "tasks/families": ("tests/test_task_families.py", "tests/test_properties.py"),
    "evaluate/heldout": ("tests/test_heldout.py",),
    "evaluate/accuracy": ("tests/test_heldout.py", "tests/test_evaluate.py"),
    "consolidate/weights": ("tests/test_consolidate_unit.py", "tests/test_checkpoint_integrity.py"),
}  # fmt: skip
"""Each module (under src/stagetrain/) and the test files that exercise it (found by grep for
its imports), of which only the fast tier runs."""

_STRICT = "the zip's other side is sibling_advantages of the same list, one advantage per value, so the lengths always match and strict is never exercised"
_SAME_RANKS = "every AutoTP rank's model file holds the same names in the same shapes (AutoTP cuts each split layer into tp equal slices), so rank 1 answers as rank 0; only tp files of one checkpoint that disagree, which DeepSpeed does not write, could tell them apart"
EQUIVALENT: dict[str, tuple[tuple[str, str, str], ...]] = {
    "grpo/advantages": (
        (
            "leaf_paths",
            "if len(path) >= len(segments):",
            "a path of len(segments) rows whose last row still has a parent already repeats a row (ids are unique, every parent exists): >= refuses the same cycles one step earlier",
        ),
        (
            "node_advantages",
            "out.update(zip((s.node_id for s in group), adv, strict=None))",
            _STRICT,
        ),
        ("node_advantages", "out.update(zip((s.node_id for s in group), adv, ))", _STRICT),
        (
            "node_advantages",
            "out.update(zip((s.node_id for s in group), adv, strict=False))",
            _STRICT,
        ),
        (
            "tree_token_advantages",
            "zip(leaf_ids, sibling_advantages([paths[i][-1].value for i in leaf_ids], eps), strict=None)",
            _STRICT,
        ),
        (
            "tree_token_advantages",
            "zip(leaf_ids, sibling_advantages([paths[i][-1].value for i in leaf_ids], eps), )",
            _STRICT,
        ),
        (
            "tree_token_advantages",
            "zip(leaf_ids, sibling_advantages([paths[i][-1].value for i in leaf_ids], eps), strict=False)",
            _STRICT,
        ),
        (
            "tree_token_advantages",
            "[torch.full((s.length,), sib[s.node_id] + leaf[i], dtype=None) for s in path]",
            "torch.full with a Python float fill makes torch's default dtype, float32, which the project never changes",
        ),
        (
            "tree_token_advantages",
            "[torch.full((s.length,), sib[s.node_id] + leaf[i], ) for s in path]",
            "torch.full with a Python float fill makes torch's default dtype, float32, which the project never changes",
        ),
    ),
    "training/integrity": (
        (
            "read_pointer",
            'return cast(None, {**pointer, "complete": tags, "layouts": layouts})',
            "typing.cast returns its value unchanged at run time, whatever the type named",
        ),
    ),
    "grpo/completions": (
        (
            "write_table",
            'rows.append("<TR>" + "".join(cell(v) for v in values) + "</tr>")',
            "HTML tag names are case-insensitive: <TR> opens the same row",
        ),
        (
            "write_table",
            'rows.append("<tr>" + "".join(cell(v) for v in values) + "</TR>")',
            "HTML tag names are case-insensitive: </TR> closes the same row",
        ),
    ),
    "grpo/loss": (
        (
            "grpo_loss",
            "m = keep.to(None)",
            ".to(None) returns the bool mask itself; every use of m (token counts, sums of kl * m, dividing float sums by them) gives the same numbers from a bool mask as from its float copy",
        ),
    ),
    "grpo/curriculum": (
        (
            "levels_for",
            "rng.randint(1, state.level - 1) if rng.random() <= cfg.earlier_share else state.level",
            "random() draws from [0, 1) in steps of 2**-53: it equals earlier_share with probability at most 2**-53, so < and <= draw the same levels",
        ),
    ),
    "grpo/tree": (
        *(
            (
                "_expand_batch",
                f"for j, (request, (i, node)) in enumerate(zip(requests, chosen, {strict})):",
                "requests is built from chosen, one request per node, so the two always have the same length",
            )
            for strict in ("strict=None", "", "strict=False")
        ),
        (
            "_expand_batch",
            "mine = [through_eos(c, None)[: request.limit] for c in continuations[j * b : (j + 1) * b]]",
            "SearchTree.expand cuts every continuation after its first eos itself (_cut), and a cut before or after the limit keeps the same tokens",
        ),
        (
            "search",
            "return search_trees([cfg], batch, lambda _, completion: score(completion), max_batch=2)[0]",
            "per_call = max(1, max_batch // B) is 1 for max_batch 2 as for 1, since B >= 2: one node per call either way",
        ),
    ),
    "consolidate/weights": (
        *(
            ("gather_tp", line, _SAME_RANKS)
            for line in (
                "if name not in shards[1]:",
                "if parts[1].shape == expected:",
                "dims = [d for d, (a, b) in enumerate(zip(parts[1].shape, expected, strict=True)) if a * tp == b]  # fmt: skip",
                'f"{name}: tp slices of shape {parts[1].shape} do not make {expected} with tp={tp}"',
            )
        ),
        *(
            (
                "gather_tp",
                line,
                "zip runs only where the slice and the shape have as many dimensions (checked on the line before), so strict never fires",
            )
            for line in (
                "dims = [d for d, (a, b) in enumerate(zip(parts[0].shape, expected, strict=None)) if a * tp == b]  # fmt: skip",
                "dims = [d for d, (a, b) in enumerate(zip(parts[0].shape, expected, )) if a * tp == b]  # fmt: skip",
                "dims = [d for d, (a, b) in enumerate(zip(parts[0].shape, expected, strict=False)) if a * tp == b]  # fmt: skip",
            )
        ),
        (
            "zero3_layout",
            "weights[name] = Stored(shape, span(slices, 0, numel, None))",
            "slices joins every rank's span of ceil(numel / world) elements, so it holds at least numel and this span never raises: its `where` is never shown",
        ),
        (
            "zero3_layout",
            "available = sum(piece.numel for piece in partitions[1])",
            "DeepSpeed's ZeRO-3 ranks hold flat groups of equal size (ceil(n / dp) of every parameter each); a rank 1 shorter than the parameters already failed in span, and one longer than rank 0 is not a file DeepSpeed writes",
        ),
    ),
    "planning/derived": (
        (
            "stage_plan",
            'return cast(None, {**shared, "stages": {stage: entry}})',
            "typing.cast returns its second argument whatever the first: the type is only for mypy",
        ),
        (
            "digest",
            'return "refused: " + hashlib.sha256(content.encode("UTF-8")).hexdigest()',
            "Python's codec names are case-insensitive: UTF-8 is utf-8",
        ),
    ),
    "tasks/verify": (
        (
            "_integer",
            'digits = match[2].lstrip("XX0XX") or "0"',
            "the digits hold no X, so stripping {X, 0} strips the same leading zeros as stripping 0",
        ),
        (
            "_integer",
            'return ("XXXX" if digits == "0" else match[1]), digits',
            "a zero's sign is compared only with another zero's, which gets the same (wrong) sign: zero still equals zero and nothing else",
        ),
        *(
            (
                "extract_answer",
                line,
                "only the part before the first split is read: splitting more often leaves it the same",
            )
            for line in (
                "text = text.split(marker, )[0]",
                "text = text.split(marker, 2)[0]",
                'text = parts[-1].split("\\n", )[0]',
                'text = parts[-1].split("\\n", 2)[0]',
            )
        ),
        *(
            (
                "normalise",
                line,
                "the text is lowercased first, so adding X to the characters stripped strips nothing more",
            )
            for line in (
                'text = " ".join(answer.split()).lower().rstrip(string.punctuation + "XX XX")',
                'text = text.lstrip("XXXX".join(c for c in string.punctuation if c not in "+-") + " ")',
                'text = text.lstrip("".join(c for c in string.punctuation if c not in "XX+-XX") + " ")',
                'text = text.lstrip("".join(c for c in string.punctuation if c not in "+-") + "XX XX")',
                'text = text.lstrip(string.punctuation + "XX XX")',
            )
        ),
        (
            "numeric",
            "if a is None and b is None:",
            "_integer reads only the normalised text, so when one side is an integer and the other not their normalised texts differ: exact gives 0.0, as a == b does",
        ),
        (
            "score",
            "if not isinstance(completion, str) and verifier is None:",
            "a non-str completion or a missing verifier then raises inside the try, whose except returns the same 0.0",
        ),
        (
            "score",
            "return 0.0 if (candidate is None) and False else verifier(candidate, problem.answer)",
            "a verifier given None raises in normalise, inside the try, whose except returns the same 0.0",
        ),
    ),
}
"""Per module, the surviving mutants that no input can tell from the original: (function, the
mutated line as mutmut's diff shows it, stripped, why it is equivalent). They are left out of
the score; every other survivor is a test gap."""

PYTEST_ARGS = ["-o", "addopts=", "-m", "not slow", "-p", "no:cacheprovider", "-p", "no:xdist"]
"""Every mutmut test run: the project's addopts (two xdist workers) off, the fast tier only."""

KILLED = {"killed", "timeout", "caught by type check"}


def slug(module: str) -> str:
    return module.replace("/", "-")


def function_of(mutant: str) -> str:
    """`stagetrain.grpo.loss.x_token_loss__mutmut_3` -> `token_loss`; methods as `Class.method`."""
    name = mutant.rpartition(".")[2].rpartition("__mutmut_")[0]
    if name.startswith("xǁ"):
        return ".".join(part for part in name[2:].split("ǁ") if part)
    return name.removeprefix("x_")


def mutated_line(diff: str) -> str:
    """The line(s) a mutant changes, as its diff's `+` lines, stripped and joined."""
    lines = diff.splitlines()
    added = [
        line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")
    ]
    return " / ".join(added)


def copy_tree(target: Path, module: str, tests: tuple[str, ...]) -> None:
    """The working tree's files (tracked and untracked, not ignored) into `target`, with
    mutmut's configuration for `module` added to the copy's pyproject.toml."""
    if target.exists():
        shutil.rmtree(target)
    names = mutants.copy_tree(target)
    also = sorted({Path(name).parts[0] for name in names} - {"src", "tests"})
    config = {
        "source_paths": ["src"],
        "only_mutate": [f"src/stagetrain/{module}.py"],
        "also_copy": also,
        "pytest_add_cli_args": PYTEST_ARGS,
        "pytest_add_cli_args_test_selection": list(tests),
        "use_git_change_detection": False,
        "track_dependencies": False,
    }
    with open(target / "pyproject.toml", "a") as out:
        out.write("\n[tool.mutmut]\n")
        for key, value in config.items():
            out.write(f"{key} = {json.dumps(value)}\n")


REPORT = r"""
import json, sys
from pathlib import Path
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
path = Path(sys.argv[1])
data = SourceFileMutationData(path=path)
data.load()
out = {}
for name, code in data.exit_code_by_key.items():
    status = status_by_exit_code[code]
    diff = "" if status == "killed" else get_diff_for_mutant(name, path=path)
    out[name] = {"status": status, "diff": diff}
json.dump(out, sys.stdout)
"""


def run_module(module: str, children: int, show: bool) -> dict:
    tests = MODULES[module]
    target = WORK / slug(module)
    copy_tree(target, module, tests)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTHONPATH", None)  # mutmut puts the copy's mutated src/ first on the path itself
    mutmut = [sys.executable, "-m", "mutmut"]
    started = time.monotonic()
    with open(target / "mutmut.log", "w") as log:
        done = subprocess.run(
            [*mutmut, "run", "--max-children", str(children)],
            cwd=target,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tail = (target / "mutmut.log").read_text(errors="replace")[-3000:]
        raise SystemExit(
            f"{module}: mutmut failed ({done.returncode}); {target}/mutmut.log ends:\n{tail}"
        )
    path = f"src/stagetrain/{module}.py"
    mutants = json.loads(
        subprocess.run(
            [sys.executable, "-c", REPORT, path],
            cwd=target,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    kept = {(function, line): why for function, line, why in EQUIVALENT.get(module, ())}
    used: set[tuple[str, str]] = set()
    killed, survived, equivalent = [], [], []
    for name, result in sorted(mutants.items(), key=lambda item: _order(item[0])):
        if result["status"] in KILLED:
            killed.append(name)
            continue
        key = (function_of(name), mutated_line(result["diff"]))
        if key in kept and result["status"] == "survived":
            used.add(key)
            equivalent.append(name)
        else:
            survived.append((name, result["status"], result["diff"]))
    counted = len(mutants) - len(equivalent)
    score = 100.0 * len(killed) / counted if counted else 100.0
    print(
        f"{module}: {len(mutants)} mutants, {len(killed)} killed, {len(survived)} survived, "
        f"{len(equivalent)} equivalent; score {len(killed)}/{counted} = {score:.1f}% in {seconds:.0f} s"
    )
    for name, status, diff in survived:
        print(f"  {status}: {name}  [{function_of(name)}] {mutated_line(diff)}")
        if show:
            print("    " + diff.replace("\n", "\n    "))
    for function, line in sorted(set(kept) - used):
        print(f"  stale EQUIVALENT entry (no surviving mutant matches): {function}: {line}")
    report = {
        "module": module,
        "mutants": len(mutants),
        "killed": len(killed),
        "survived": len(survived),
        "equivalent": len(equivalent),
        "score": round(score, 1),
        "seconds": round(seconds),
        "survivors": [{"name": n, "status": s, "diff": d} for n, s, d in survived],
    }
    (target / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _order(name: str) -> tuple[str, int]:
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number) if number.isdigit() else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("modules", nargs="*", help="modules under src/stagetrain/, e.g. grpo/loss")
    parser.add_argument("--all", action="store_true", help="every module of MODULES")
    parser.add_argument("--list", action="store_true", help="the modules and their tests")
    parser.add_argument("--show", action="store_true", help="the diff of every surviving mutant")
    parser.add_argument(
        "--children", type=int, default=2, help="mutants tested at once (default 2)"
    )
    args = parser.parse_args()
    if args.list:
        for module, tests in MODULES.items():
            print(f"{module}: {' '.join(tests)}")
        return 0
    modules = list(MODULES) if args.all else [m.removesuffix(".py") for m in args.modules]
    unknown = [m for m in modules if m not in MODULES]
    if unknown or not modules:
        parser.error(f"name modules of MODULES (--list), or --all; unknown: {unknown}")
    reports = [run_module(module, args.children, args.show) for module in modules]
    if len(reports) > 1:
        print(f"\n{'module':24} {'killed':>7} {'total':>6} {'equiv':>6} {'score':>7} {'time':>7}")
        for r in reports:
            total = r["mutants"] - r["equivalent"]
            print(
                f"{r['module']:24} {r['killed']:>7} {total:>6} {r['equivalent']:>6} {r['score']:>6.1f}% {r['seconds']:>6}s"
            )
    below = [r["module"] for r in reports if r["score"] < GOAL]
    if below:
        print(f"below {GOAL:.0f}%: {', '.join(below)}")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
