"""Stages rerun exactly when what they read changes: config keys, declared files, library code.

The rerun matrix changes every leaf key of the config schema in a copy of a
finished small run's config, dry-runs Snakemake, and compares the scheduled
jobs with the expected set built from READERS, a table written here by hand
(which rule reads which key) and the fixed order of the stages. It is printed
(`pytest -s`) and written to the test's tmp folder as rerun_matrix.txt.

Keys are grouped to keep the suite fast (a dry run costs a Snakemake start):
keys of one section whose expected set is the same change together in one dry
run, except the keys the workflow selects one by one (the planner's subset of
tokenizer, pretrain and grpo, the steps and passes of the DeepSpeed config, the
file keys, run.*), which each get their own. The test prints how many dry runs
over how many keys; the counts follow the schema, so no document states them.
A key the planner reads reruns plan_parallelism (plan.json, which no stage reads)
and the jobs of the plan parts that change (plan/vocab.json, plan/<stage>.json),
with their readers: the expected set adds those, found by planning the changed
config here (planning.ahead, the path the DAG takes). So a row fails when a
replan reruns a stage whose part did not change, and
test_a_replan_runs_what_its_dry_run_listed holds dry runs against real runs. A
changed hardware key detects again, and what the new plan holds is unknown until
then: that dry run lists every part. Each dry run also lists what it imported: only one
whose edit changes a model's counted shape may import torch or transformers (a `snakemake`
that does pays seconds for it, in every command a user types).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.configs import model_settings
from harness.workflow import REPO, SNAKEMAKE, snakemake

from stagetrain.config import validation as stconfig
from stagetrain.errors import StageError
from stagetrain.io import json_bytes
from stagetrain.planning.ahead import plan_ahead, planner_sections
from stagetrain.planning.derived import digest, part_of
from stagetrain.planning.shape import shape_key

pytestmark = pytest.mark.slow
RUN = "results/tiny"
PARTS = ("vocab", "pretrain", "grpo")
JOBS = ["detect_hardware", "plan_parallelism", *(f"plan_part[{part}]" for part in PARTS), "prepare_tokenizer",
        "render_deepspeed_config[pretrain]", "render_deepspeed_config[grpo]", "pretrain", "consolidate[pretrain]",
        "grpo", "consolidate[grpo]", "all"]  # fmt: skip
# Each job's direct dependents (what a dry run schedules after it).
AFTER = {
    # Until detection has run, no part of the plan is known (Snakemake's <TBD>).
    "detect_hardware": {"plan_parallelism", *(f"plan_part[{part}]" for part in PARTS)},
    "plan_parallelism": {"all"},  # no stage reads plan.json
    # A part's job reruns when the part's bytes change (a param), and its readers with it.
    "plan_part[vocab]": {"prepare_tokenizer"},
    "plan_part[pretrain]": {
        "render_deepspeed_config[pretrain]",
        "pretrain",
        "consolidate[pretrain]",
    },
    "plan_part[grpo]": {"render_deepspeed_config[grpo]", "grpo", "consolidate[grpo]"},
    "prepare_tokenizer": {"pretrain", "consolidate[pretrain]", "grpo", "consolidate[grpo]"},
    "render_deepspeed_config[pretrain]": {"pretrain"},
    "render_deepspeed_config[grpo]": {"grpo"},
    "pretrain": {"consolidate[pretrain]"},
    "consolidate[pretrain]": {"grpo"},
    "grpo": {"consolidate[grpo]"},
    "consolidate[grpo]": {"all"},
    "all": set(),
}
DROP = object()  # a key left out of the changed config
RENDER = {"render_deepspeed_config[pretrain]", "render_deepspeed_config[grpo]"}
CONSOLIDATE = {"consolidate[pretrain]", "consolidate[grpo]"}
# Which jobs read which key: the first matching prefix wins.
READERS: list[tuple[str, set[str]]] = [
    ("run.name", set(JOBS)),  # a new results folder
    ("run.seed", {"prepare_tokenizer", "pretrain", "grpo"}),
    ("model.", {"plan_parallelism", "prepare_tokenizer", "pretrain"}),
    ("tokenizer.vocab_size", {"plan_parallelism", "prepare_tokenizer"}),
    ("tokenizer.", {"prepare_tokenizer"}),
    ("data.", {"prepare_tokenizer"}),
    ("tasks.families", {"prepare_tokenizer", "grpo"}),  # the problems feed the corpus; the rewards only GRPO
    ("tasks.max_rows", {"prepare_tokenizer", "grpo"}),  # which problems a file family holds
    ("tasks.", {"grpo"}),
    ("hardware.", {"detect_hardware", "plan_parallelism"}),
    # Only a deepseek_v3 may split its experts, so the matrix changes the model with it.
    ("parallelism.ep", {"plan_parallelism", "prepare_tokenizer", "pretrain"}),
    ("parallelism.", {"plan_parallelism"}),
    ("deepspeed.", {"plan_parallelism", *RENDER}),
    *((f"pretrain.{k}", {"plan_parallelism", "pretrain"}) for k in ("seq_len", "global_batch_size", "global_batch_unit")),
    *((f"pretrain.{k}", {"render_deepspeed_config[pretrain]", "pretrain"}) for k in ("steps", "optimizer.")),
    ("pretrain.", {"pretrain"}),
    *((f"grpo.{k}", {"plan_parallelism", "grpo"}) for k in ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "kl_coef")),
    *((f"grpo.{k}", {"render_deepspeed_config[grpo]", "grpo"}) for k in ("steps", "passes", "optimizer.")),
    # Only an MoE model may set it, so the matrix changes the model with it; grpo alone reads it.
    ("grpo.router_aux_loss_coef", {"plan_parallelism", "prepare_tokenizer", "pretrain", "grpo"}),
    ("grpo.", {"grpo"}),
    ("tracking.", {"pretrain", "grpo"}),
    ("consolidate.", CONSOLIDATE),
    ("evaluate.", set()),  # the optional targets' sections: nothing of `all` reads them
    ("publish.", set()),
]  # fmt: skip
# Keys the workflow passes one by one (not as a whole section): each gets its own dry run.
ALONE = re.compile(
    r"tokenizer\.vocab_size|pretrain\.(seq_len|global_batch_size|global_batch_unit|steps)|"
    r"grpo\.(prompts_per_step|group_size|max_prompt_len|max_new_tokens|kl_coef|steps|passes)|"
    r"parallelism\.table_path|model\.init_from|tokenizer\.path|data\.files|tasks\.families|run\..*"
)
DEEPSEEK = {"model.architecture": "deepseek_v3", "model.num_experts": 4, "model.experts_per_token": 2,
            "model.moe_intermediate_size": 64, "model.num_shared_experts": 1, "model.first_dense_layers": 1,
            "model.num_kv_heads": 4}  # fmt: skip
"""The default model as a deepseek_v3 (its latent attention has as many key/value heads as heads)."""
# Changed values the generic rule below cannot find: other keys that must change with them.
OVERRIDES: dict[str, dict[str, Any]] = {
    "run.name": {"run.name": "other"},
    "model.architecture": {"model.architecture": "mixtral", "model.num_experts": 4, "model.experts_per_token": 2},
    "model.num_experts": {"model.architecture": "mixtral", "model.num_experts": 4, "model.experts_per_token": 2},
    "model.experts_per_token": {"model.architecture": "mixtral", "model.num_experts": 4, "model.experts_per_token": 2},
    "model.router_aux_loss_coef": {"model.architecture": "mixtral", "model.num_experts": 4, "model.experts_per_token": 2,
                                   "model.router_aux_loss_coef": 0.01},
    "model.moe_intermediate_size": {"model.architecture": "qwen2_moe", "model.num_experts": 4,
                                    "model.experts_per_token": 2, "model.moe_intermediate_size": 64},
    "model.num_shared_experts": DEEPSEEK,
    "model.first_dense_layers": DEEPSEEK,
    "model.router_bias_update_rate": {**DEEPSEEK, "model.router_bias_update_rate": 0.01},
    "tokenizer.source": {"tokenizer.source": "pretrained", "tokenizer.path": "gpt2"},
    "tokenizer.pad_token": {"tokenizer.pad_token": "<|pad|>"},
    "hardware.source": {"hardware.source": "describe", "hardware.gpu": "H100", "hardware.gpus_per_node": 2},
    "hardware.gpu": {"hardware.source": "describe", "hardware.gpu": "H100", "hardware.gpus_per_node": 2},
    "hardware.gpus_per_node": {"hardware.source": "describe", "hardware.gpu": "H100", "hardware.gpus_per_node": 2},
    "parallelism.ep": {**DEEPSEEK, "parallelism.ep": 2},
    "parallelism.table_repo": {"parallelism.table_repo": "org/tables"},
    "parallelism.table_revision": {"parallelism.table_revision": "v2"},
    "data.hub": {"data.hub": [{"repo": "org/corpus", "files": ["train.jsonl"]}]},
    "data.generated.families": {"data.generated.families": ["arithmetic"]},
    "data.generated.level_weights": {"data.generated.max_level": 3, "data.generated.level_weights": [3, 1, 1]},
    "grpo.router_aux_loss_coef": {"model.architecture": "mixtral", "model.num_experts": 4, "model.experts_per_token": 2,
                                  "grpo.router_aux_loss_coef": 0.01},
    "grpo.curriculum.families": {"grpo.curriculum.families": ["comparison"]},
    "grpo.replay.families": {"grpo.replay.families": ["arithmetic"]},
    "grpo.sampler_correction.cap": {"grpo.sampler_correction": {"cap": 2.0}},
    "consolidate.max_shard_size": {"consolidate.max_shard_size": "1MB"},
    "tracking.report_to": {"tracking.report_to": []},
    "tracking.wandb_project": {"tracking.wandb_project": "other"},
    "tracking.mlflow.tracking_uri": {"tracking.mlflow.tracking_uri": "http://127.0.0.1:5000"},
    "tracking.mlflow.experiment": {"tracking.mlflow.experiment": "other"},
    "evaluate.levels": {"evaluate.levels": [1]},
    "evaluate.tasks": {"evaluate.tasks": ["hellaswag"]},
    "publish.repo": {"publish.repo": "me/model"},
    "publish.revision": {"publish.revision": "dev"},
    "publish.license": {"publish.license": "mit"},
}  # fmt: skip


def readers(key: str) -> set[str]:
    """The jobs that read `key`, from READERS."""
    return next(jobs for prefix, jobs in READERS if key == prefix or key.startswith(prefix))


def downstream(jobs: set[str]) -> set[str]:
    """`jobs` and every job after them."""
    found, queue = set(), list(jobs)
    while queue:
        job = queue.pop()
        if job not in found:
            found.add(job)
            queue.extend(AFTER[job])
    return found


def schema_leaves() -> list[tuple[str, dict[str, Any]]]:
    """Every leaf key of the config schema with its schema node ($refs resolved; arrays are leaves)."""
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())

    def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
        if "properties" in node:
            for key, child in node["properties"].items():
                yield from walk(child, f"{path}.{key}" if path else key)
        else:
            yield path, node

    return list(walk(schema, ""))


def get(config: dict[str, Any], key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def put(config: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` (dotted) to `value`; DROP removes it."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if value is DROP:
        node.pop(last, None)
    else:
        node[last] = value


def changed(key: str, node: dict[str, Any], current: Any, files: dict[str, Any]) -> dict[str, Any]:
    """A valid changed value for `key` (and the keys that must change with it)."""
    if key in files:
        return files[key]
    if key in OVERRIDES:
        return OVERRIDES[key]
    kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    if "enum" in node:
        return {key: next(v for v in node["enum"] if v not in (current, None))}
    if "boolean" in kinds:
        return {key: not current}
    if "integer" in kinds:
        value = (current or 1) + 1
        return {key: value if value <= node.get("maximum", value) else current - 1}
    if "number" in kinds:
        return {key: current * 0.5 if current else 0.05}
    if "array" in kinds and key.endswith("betas"):
        return {key: [0.8, 0.9]}
    raise AssertionError(f"no changed value for {key} ({node})")


def local_files(root: Path) -> dict[str, dict[str, Any]]:
    """Files the file keys can name, made under `root`, and their changes."""
    (root / "corpus").mkdir(parents=True)
    (root / "corpus/a.txt").write_text("one document\n")
    (root / "corpus/b.txt").write_text("another document\n")
    (root / "capitals.jsonl").write_text(
        json.dumps({"prompt": "Capital of France?", "answer": "Paris", "level": 1}) + "\n"
    )
    (root / "table.json").write_text("{}\n")
    shape = dict.fromkeys(f"model.{k}" for k in ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                 "num_kv_heads", "max_position_embeddings", "rope_theta", "tie_word_embeddings"))  # fmt: skip
    return {
        "parallelism.table_path": {"parallelism.table_path": str(root / "table.json")},
        "data.files": {"data.files": [{"path": str(root / "corpus/*.txt")}]},
        "tasks.families": {"tasks.families": [{"name": "capitals", "files": [str(root / "capitals.jsonl")]}]},
        "tokenizer.path": {"tokenizer.source": "pretrained", "tokenizer.path": str(root / "model")},
        "model.init_from": {"model.init_from": str(root / "model"), **dict.fromkeys(shape, DROP)},
    }  # fmt: skip


def dry_run(workdir: Path, config: dict[str, Any] | None, *, env: dict[str, str] | None = None,
            check: bool = True, tag: str = "") -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`snakemake -n` in `workdir`, with `config` as its only --configfile (when given; written to
    a file named with `tag`, so that dry runs can run side by side)."""
    args = [SNAKEMAKE, "--cores", "2", "-n"]
    if config is not None:
        path = workdir / f".rerun_config{tag}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        args += ["--configfile", str(path)]
    proc = subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake -n exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


IMPORTS_LISTED = {"PYTHONPROFILEIMPORTTIME": "1"}
"""Python lists every module it imports, and the time it took, on stderr."""
HEAVY = ("torch", "transformers", "deepspeed")
"""What a DAG build must not import unless it counts a model's shape: seconds of every `snakemake`."""


def heavy_imports(stderr: str) -> set[str]:
    """Which of HEAVY a process run with IMPORTS_LISTED imported."""
    return set(re.findall(rf"^import time:.*\|\s+({'|'.join(HEAVY)})$", stderr, flags=re.M))


def shape_of(config: dict[str, Any]) -> str | None:
    """The key the DAG keeps `config`'s counted model shape under (planning.shape.shape_key)."""
    return shape_key(model_settings(config["model"]), config["tokenizer"]["vocab_size"], 1)


def scheduled(out: str) -> dict[str, dict[str, str]]:
    """Jobs of a dry run's output, named rule[stage], each with its reason and input line."""
    jobs = {}
    for block in re.split(r"\n(?:rule|checkpoint) ", out)[1:]:
        rule = block.split(":", 1)[0].strip()
        stage = re.search(r"wildcards: (?:stage|part)=(\w+)", block)
        fields = {
            k: (re.search(rf"^\s+{k}: (.*)$", block, re.M) or [None, ""])[1]
            for k in ("reason", "input")
        }
        jobs[f"{rule}[{stage.group(1)}]" if stage else rule] = fields
    return jobs


def part_digests(workdir: Path, config: dict[str, Any]) -> dict[str, str]:
    """The digest of each plan part as the DAG works it out for `config` on the finished run's
    hardware.json (planning.ahead, the plan_part rule's own trigger)."""
    try:
        sections = planner_sections(stconfig.validate(copy.deepcopy(config)))
    except StageError as err:
        return dict.fromkeys(PARTS, str(err))
    plan = plan_ahead(
        workdir / "no-recorded-plan.json", "", workdir / RUN / "hardware.json", sections
    )
    return {part: digest(part_of(plan, part)) for part in PARTS}


def replanned(workdir: Path, base: dict[str, Any], config: dict[str, Any]) -> set[str]:
    """The plan_part jobs whose part comes out different for `config` than for `base`."""
    before, after = part_digests(workdir, base), part_digests(workdir, config)
    return {f"plan_part[{part}]" for part in PARTS if before[part] != after[part]}


def finished_config(workdir: Path) -> dict[str, Any]:
    """The finished run's config, every default filled in (so a --configfile of it changes nothing)."""
    return stconfig.load(workdir / "config/config.yaml")


def test_rerun_matrix_over_every_config_key(finished_small_run: Path, tmp_path: Path) -> None:
    workdir = finished_small_run
    base = finished_config(workdir)
    noop = dry_run(workdir, base, env=IMPORTS_LISTED)
    assert "Nothing to be done" in noop.stdout and not heavy_imports(noop.stderr)
    files = local_files(tmp_path)
    shutil.copytree(workdir / RUN / "model/pretrain", tmp_path / "model")
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for key, node in schema_leaves():
        expected = downstream(readers(key))
        name = (key,) if ALONE.fullmatch(key) else (key.split(".")[0], *sorted(expected))
        groups.setdefault(name, {"keys": [], "changes": {}, "expected": expected})
        groups[name]["keys"].append(key)
        groups[name]["changes"].update(changed(key, node, get(base, key), files))

    def config_of(group: dict[str, Any]) -> dict[str, Any]:
        config = copy.deepcopy(base)
        for key, value in group["changes"].items():
            put(config, key, value)
        return config

    for group in groups.values():
        if "plan_parallelism" in group["expected"] and "detect_hardware" not in group["expected"]:
            group["expected"] |= downstream(replanned(workdir, base, config_of(group)))

    def jobs_after(index: int, group: dict[str, Any]) -> set[str]:
        proc = dry_run(workdir, config_of(group), tag=f"-{index}", env=IMPORTS_LISTED)
        group["imported"] = heavy_imports(proc.stderr)
        return set(scheduled(proc.stdout))

    # Two dry runs at a time: each is a mostly single-threaded Snakemake process, and a dry
    # run neither locks the folder nor writes to it.
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(jobs_after, range(len(groups)), groups.values()))
    # Snakemake's own process plans with a kept model shape (planning.shape.cached_shape) and
    # checks the config with plain data: only a changed shape imports the model libraries.
    counted = [g["keys"] for g in groups.values()
               if g["imported"] and shape_of(config_of(g)) == shape_of(base)]  # fmt: skip
    assert not counted, f"these dry runs imported torch or transformers: {counted}"
    lines, wrong = [], []
    for group, got in zip(groups.values(), found, strict=True):
        mark = "ok" if got == group["expected"] else "WRONG"
        lines.append(
            f"{mark:5} {', '.join(group['keys'])}\n      -> {', '.join(j for j in JOBS if j in got) or 'nothing'}"
        )
        if got != group["expected"]:
            wrong.append(
                f"{group['keys']}: expected {sorted(group['expected'])}, got {sorted(got)}"
            )
    report = "\n".join(lines)
    (tmp_path / "rerun_matrix.txt").write_text(report + "\n")
    print(f"\nrerun matrix ({len(groups)} dry runs over {len(schema_leaves())} keys):\n{report}")
    assert not wrong, "\n".join(wrong)


def test_every_local_file_is_a_declared_input_and_a_missing_one_is_one_line(
    finished_small_run: Path, tmp_path: Path
) -> None:
    workdir = finished_small_run
    base = finished_config(workdir)
    files = local_files(tmp_path)
    shutil.copytree(workdir / RUN / "model/pretrain", tmp_path / "model")
    config = copy.deepcopy(base)
    for changes in files.values():
        for key, value in changes.items():
            put(config, key, value)
    jobs = scheduled(dry_run(workdir, config).stdout)
    model = sorted(str(p) for p in (tmp_path / "model").iterdir() if p.is_file())
    weights = [f for f in model if f.endswith(".safetensors")]
    corpus = [
        str(tmp_path / "corpus/a.txt"),
        str(tmp_path / "corpus/b.txt"),
        str(tmp_path / "capitals.jsonl"),
    ]
    assert str(tmp_path / "table.json") in jobs["plan_parallelism"]["input"]
    assert all(f in jobs["prepare_tokenizer"]["input"] for f in [*corpus, *model])
    assert all(f in jobs["pretrain"]["input"] for f in model)
    assert not any(
        f in jobs["plan_parallelism"]["input"] for f in weights
    )  # the planner reads the config

    put(config, "data.files", [{"path": "corpus/*.md"}])
    proc = dry_run(workdir, config, check=False)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "error: config: data.files.0.path: no file matches 'corpus/*.md'"
    )


def test_an_edited_table_reruns_the_planner(finished_small_run: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "wf"
    shutil.copytree(finished_small_run, workdir, symlinks=True)
    table = workdir / "table.json"
    table.write_text("{}\n")
    config = finished_config(workdir)
    put(config, "parallelism.table_path", str(table))
    path = workdir / "config/config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake(workdir, "plan_parallelism")
    table.write_text('{"H100": {}}\n')
    reason = scheduled(dry_run(workdir, None).stdout)["plan_parallelism"]["reason"]
    assert reason == f"Updated input files: {table}"


def test_an_edited_reward_file_reruns_grpo_and_nothing_upstream(finished_copy: Path) -> None:
    """The finished run declares examples/largest with its reward file: the user's reward code is a
    declared input of GRPO, and of nothing before it."""
    reward = finished_copy / "examples/largest/reward.py"
    reward.write_text(reward.read_text() + "\n# edited\n")
    jobs = scheduled(dry_run(finished_copy, None).stdout)
    assert set(jobs) == downstream({"grpo"})
    assert jobs["grpo"]["reason"] == "Updated input files: examples/largest/reward.py"


@pytest.mark.parametrize(
    ("module", "runs_it"),
    [
        ("hardware/detect.py", {"detect_hardware"}),
        ("planning/search.py", {"plan_parallelism"}),
        ("tokenizer/prepare.py", {"prepare_tokenizer"}),
        ("training/deepspeed_config.py", RENDER),
        ("pretrain/train.py", {"pretrain"}),  # the stages are siblings: GRPO never imports it
        ("training/loop.py", {"pretrain", "grpo"}),  # the shared runtime runs in both
        ("consolidate/writer.py", CONSOLIDATE),
        ("grpo/loss.py", {"grpo"}),
    ],
)
def test_an_edited_library_module_reruns_the_stages_that_run_it(
    finished_small_run: Path, tmp_path: Path, module: str, runs_it: set[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(REPO / "src/stagetrain", src / "stagetrain")
    with open(src / "stagetrain" / module, "a") as handle:
        handle.write("\n# edited\n")
    jobs = scheduled(dry_run(finished_small_run, None, env={"PYTHONPATH": str(src)}).stdout)
    assert set(jobs) == downstream(runs_it)
    # Snakemake names one reason: a job after another rerun job gives "Input files updated".
    first = {
        job for job in runs_it if not any(job in downstream(AFTER[other]) for other in runs_it)
    }
    assert all(jobs[job]["reason"].startswith("Params have changed") for job in first)


# One key of each section the planner reads, the value it takes, and the target of the real run:
# "plan" is the plan's own files (plan.json and the training stages' parts), "all" everything.
REPLANS = {
    "hardware.inter_node_gbps": (25.0, "plan"),  # detects again: the dry run cannot know the parts
    "model.num_kv_heads": (4, "plan"),
    "tokenizer.vocab_size": (600, "plan"),
    "parallelism.assumed_mfu": (0.3, "plan"),  # GPUs' alone: a CPU plan keeps every part
    "deepspeed.precision": ("bf16", "plan"),
    "pretrain.seq_len": (64, "plan"),
    "grpo.group_size": (2, "all"),  # the README's example: the whole run, GRPO retrained
}


def ran_jobs(log: str) -> set[str]:
    """The jobs a real Snakemake run ran, from its log, named as `scheduled` names them."""
    jobs = set()
    for block in re.split(r"\n(?:local)?(?:rule|checkpoint) (?=\w+:\n)", log)[1:]:
        rule = block.split(":", 1)[0]
        stage = re.search(r"wildcards: (?:stage|part)=(\w+)", block)
        jobs.add(f"{rule}[{stage.group(1)}]" if stage else rule)
    return jobs


@pytest.mark.parametrize("key", REPLANS)
def test_a_replan_runs_what_its_dry_run_listed(
    finished_small_run: Path, tmp_path: Path, key: str
) -> None:
    """The dry run after an edit the planner reads lists the planner and the jobs of the parts that
    change, before the planner has run, and not one whose part the real run then leaves
    byte-identical. `all` runs exactly what its dry run listed; the plan's files a part of it. Only a new detection is not known ahead:
    its dry run lists every part, and the real run reruns only those that changed."""
    workdir = tmp_path / "wf"
    shutil.copytree(finished_small_run, workdir, symlinks=True)
    value, target = REPLANS[key]
    config = finished_config(workdir)
    assert get(config, key) != value
    put(config, key, value)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    parts = {part: (workdir / RUN / "plan" / f"{part}.json").read_bytes() for part in PARTS}

    targets = {"all", "plan"}  # rules without outputs, listed when anything before them runs
    listed = set(scheduled(dry_run(workdir, None).stdout))
    files = [f"{RUN}/plan.json", f"{RUN}/plan/pretrain.json", f"{RUN}/plan/grpo.json"]
    proc = snakemake(workdir, *(files if target == "plan" else [target]))
    ran = ran_jobs(proc.stdout + proc.stderr) - targets
    left = set(scheduled(dry_run(workdir, None).stdout)) - targets
    kept = {f"plan_part[{part}]" for part, before in parts.items()
            if (workdir / RUN / "plan" / f"{part}.json").read_bytes() == before}  # fmt: skip
    assert "plan_parallelism" in ran
    assert not ran & kept, f"{sorted(ran & kept)} ran although their part is kept"
    assert ran | left <= listed and not ran & left
    if key.startswith("hardware."):
        assert listed == set(JOBS)
    else:
        assert not listed & kept, f"{sorted(listed & kept)} listed although their part is kept"
        assert {"plan_part[pretrain]", "plan_part[grpo]"} - kept <= ran  # the `plan` target's parts
    if target == "all":
        assert ran == listed - targets
        assert not left
    # What the parts hold is the plan of the edited config, planned afresh here (not a plan the
    # DAG reused): the `plan` target writes the training stages' parts, `all` every one.
    fresh = plan_ahead(workdir / "no-recorded-plan.json", "", workdir / RUN / "hardware.json",
                       planner_sections(stconfig.validate(copy.deepcopy(config))))  # fmt: skip
    for part in PARTS if target == "all" else ("pretrain", "grpo"):
        written = (workdir / RUN / "plan" / f"{part}.json").read_bytes()
        assert written == json_bytes(part_of(fresh, part)), (
            f"plan/{part}.json is not the new plan's"
        )


def test_a_new_shard_size_rewrites_the_model_and_grpo_resumes_at_its_final_step(
    finished_small_run: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "wf"
    shutil.copytree(finished_small_run, workdir, symlinks=True)
    run = workdir / RUN
    before = json.loads((run / "model/pretrain/MANIFEST.json").read_text())
    first = json.loads((run / "grpo/summary.json").read_text())
    config = finished_config(workdir)
    put(config, "consolidate.max_shard_size", "1MB")
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake(workdir, "all")

    after = json.loads((run / "model/pretrain/MANIFEST.json").read_text())
    assert len([f for f in after["files"] if f.endswith(".safetensors")]) > 1
    assert set(after["files"]) != set(before["files"])
    assert after["weights_sha256"] == before["weights_sha256"]
    grpo = json.loads((run / "grpo/summary.json").read_text())
    assert grpo["fingerprint"] == first["fingerprint"]
    assert grpo["resumed_from_step"] == grpo["final_step"] == first["final_step"]
    assert grpo["optimizer_steps"] == first["optimizer_steps"]  # restored, none taken
    log = (run / "logs/grpo.log").read_text()
    assert f"at step {first['final_step']}" in log and not re.search(r"step \d+/\d+ reward", log)
    assert "Nothing to be done" in dry_run(workdir, None).stdout
