"""What the stages read: local files, derived plan files, library modules, the weights by content."""

from __future__ import annotations

import copy
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness.workflow import REPO, checked, default_config

from stagetrain.config.inputs import local_inputs
from stagetrain.config.settings import Settings
from stagetrain.consolidate.folder import weights_sha256
from stagetrain.consolidate.writer import write_shards
from stagetrain.errors import StageError
from stagetrain.io import json_bytes
from stagetrain.planning.derived import (
    SHARED_KEYS,
    digest,
    part_of,
    stage_plan,
    vocab_padding,
    whole_plan,
)
from stagetrain.workflow.codedeps import code_digest, modules_of


def _config(**sections: dict) -> Settings:
    config = copy.deepcopy(default_config())
    for section, changes in sections.items():
        config[section].update(changes)
    return Settings.from_config(checked(config))


def test_every_local_file_is_listed_sorted_and_hub_ids_are_not(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    for name in ("b.txt", "a.txt", "c.jsonl"):
        (tmp_path / "corpus" / name).write_text("x\n")
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        (model / name).write_text("{}")
    table = tmp_path / "table.json"
    table.write_text("{}")
    tasks = tmp_path / "capitals.jsonl"
    tasks.write_text("{}\n")
    data = {"files": [{"path": f"{tmp_path}/corpus/*.txt"}, {"path": f"{tmp_path}/corpus/a.*"}]}
    found = local_inputs(_config(
        data=data, parallelism={"table_path": str(table)}, model={"init_from": str(model)},
        tasks={"families": [{"name": "capitals", "files": [str(tasks)], "rewards": None}]},
        tokenizer={"source": "pretrained", "path": str(model)},
    ))  # fmt: skip
    assert found["data_files"] == [f"{tmp_path}/corpus/a.txt", f"{tmp_path}/corpus/b.txt"]
    assert found["table"] == [str(table)] and found["task_files"] == [str(tasks)]
    files = [str(model / n) for n in ("config.json", "model.safetensors", "sub/tokenizer.json")]
    assert found["init_from"] == found["tokenizer"] == files
    assert found["init_from_config"] == [files[0], files[2]]

    hub = local_inputs(
        _config(
            model={"init_from": "org/model"}, tokenizer={"source": "pretrained", "path": "gpt2"}
        )
    )
    assert not any(hub.values())
    unused = local_inputs(_config(tokenizer={"source": "train", "path": "./nowhere"}))
    assert not unused["tokenizer"]


@pytest.mark.parametrize(
    ("sections", "line"),
    [
        ({"data": {"files": [{"path": "corpus/*.txt"}]}}, "config: data.files.0.path: no file matches 'corpus/*.txt'"),
        ({"parallelism": {"table_path": "missing.json"}}, "config: parallelism.table_path: no such file 'missing.json'"),
        ({"model": {"init_from": "./models/none"}}, "config: model.init_from: no such file or folder './models/none'"),
        ({"tokenizer": {"source": "pretrained", "path": "/no/tok"}}, "config: tokenizer.path: no such file or folder '/no/tok'"),
        ({"tasks": {"families": [{"name": "mine", "files": ["tasks/none.jsonl"], "rewards": None}]}},
         "config: tasks.families.0.files.0: no file matches 'tasks/none.jsonl'"),
        ({"tasks": {"families": [{"name": "mine", "files": ["examples/largest/largest.parquet"], "rewards": [{"function": "tasks/r.py:score"}]}]}},
         "config: tasks.families.0.rewards.0.function: no such reward file 'tasks/r.py'"),
        ({"tasks": {"families": [{"name": "mine", "files": ["examples/largest/largest.parquet"], "rewards": [{"function": "trl.rewards:accuracy_reward", "kwargs": {"x": 1}}]}]}},
         "config: tasks.families.0.rewards.0.function: trl.rewards:accuracy_reward cannot be called with kwargs {'x': 1} (no value for 'completions'; no value for 'solution')"),
        ({"tasks": {"families": [{"name": "mine", "files": ["examples/largest/largest.parquet"], "rewards": [{"function": "operator:add"}]}]}},
         "config: tasks.families.0.rewards.0.function: operator:add cannot take TRL's keyword call: it has positional-only parameters (a, b): every argument is passed by keyword"),
        ({"tasks": {"families": [{"name": "mine", "files": ["examples/largest/largest.parquet"], "rewards": [{"verifier": "exact", "kwargs": {}}]}]}},
         "config: tasks.families.0.rewards.0.kwargs: only a function takes kwargs (a factory's arguments)"),
    ],
)  # fmt: skip
def test_a_missing_local_file_is_one_line_naming_its_key(sections: dict, line: str) -> None:
    with pytest.raises(StageError) as err:
        local_inputs(_config(**sections))
    assert str(err.value) == line


@pytest.mark.parametrize("key", ["model.init_from", "tokenizer.path"])
def test_a_hub_id_whose_namespace_is_a_local_folder_must_say_which_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    """`models/my-modell` (misspelt, with models/ here) was asked of the hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    section, name = key.split(".")
    changes = {name: "models/my-modell"} | (
        {"source": "pretrained"} if section == "tokenizer" else {}
    )
    with pytest.raises(StageError) as err:
        local_inputs(_config(**{section: changes}))
    assert str(err.value) == (
        f"config: {key}: 'models/my-modell' is not a local folder, so it would be taken for a hub id, "
        "though models/ is a folder here: write ./models/my-modell for a local folder (then it must "
        "exist), or move models/ away to mean the hub repository"
    )
    assert not any(local_inputs(_config(**{section: {**changes, name: "org/model"}})).values())


def test_each_reader_gets_only_its_part_of_the_plan() -> None:
    plan = {key: key for key in SHARED_KEYS} | {
        "table": {},
        "warnings": ["w"],
        "source": "estimated",
    }
    plan["stages"] = {"pretrain": {"layout": {"tp": 2}}, "grpo": {"layout": {"tp": 4}}}
    assert vocab_padding(plan) == {"tp": 4}
    grpo = stage_plan(plan, "grpo")
    assert grpo == {**{key: key for key in SHARED_KEYS}, "stages": {"grpo": {"layout": {"tp": 4}}}}


def test_a_part_is_the_vocab_the_stages_entry_or_the_planners_refusal_and_its_digest_the_written_bytes() -> (
    None
):
    """part_of gives what plan_part writes and digest what the rule's params compare: the sha256
    of the file's bytes as written (json_bytes), or, for a refusal, of its text, marked apart."""
    plan = {key: key for key in SHARED_KEYS} | {"table": {}}
    plan["stages"] = {"vocab_stage": {"layout": {"tp": 2}}, "grpo": {"layout": {"tp": 3}}}
    assert part_of(plan, "vocab") == {"tp": 6}
    assert part_of(plan, "grpo") == stage_plan(plan, "grpo")
    assert part_of(plan, "vocab_stage") == stage_plan(plan, "vocab_stage")
    assert part_of("no layout fits: é", "grpo") == "no layout fits: é"
    part = part_of(plan, "grpo")
    assert digest(part) == "sha256:" + hashlib.sha256(json_bytes(part)).hexdigest()
    assert digest("no layout fits: é") == (
        "refused: " + hashlib.sha256("no layout fits: é".encode()).hexdigest()
    )


def test_a_stages_part_finds_the_whole_plan_beside_its_plan_folder(tmp_path: Path) -> None:
    (tmp_path / "run" / "plan").mkdir(parents=True)
    assert whole_plan(tmp_path / "run" / "plan" / "pretrain.json") == tmp_path / "run" / "plan.json"
    assert (
        whole_plan(str(tmp_path / "run" / "plan" / "grpo.json")) == tmp_path / "run" / "plan.json"
    )


def _package(root: Path, sources: dict[str, str]) -> Path:
    """A `stagetrain` package of `sources` (relative path -> text) under `root`; its folder."""
    pkg = root / "stagetrain"
    for name, text in sources.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_a_scripts_modules_are_found_by_reading_the_sources(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from . import two\nfrom .three import thing\n",
        "a/two.py": "import json\n",
        "a/three.py": "thing = 1\n",
        "b.py": "",
        "c.py": "",
    })  # fmt: skip
    script = tmp_path / "script.py"
    script.write_text('from stagetrain.a.one import x\nMODULE = "stagetrain.b"\n')
    found = [str(p.relative_to(pkg)) for p in modules_of(script, tmp_path)]
    assert found == ["__init__.py", "a/__init__.py", "a/one.py", "a/three.py", "a/two.py", "b.py"]
    before = code_digest(script, tmp_path)
    (pkg / "c.py").write_text("# not reached\n")
    assert code_digest(script, tmp_path) == before
    (pkg / "a/three.py").write_text("thing = 2\n")
    assert code_digest(script, tmp_path) != before


def test_kept_import_names_serve_only_the_bytes_they_were_parsed_from(tmp_path: Path) -> None:
    """Each `snakemake` keeps what every source imports (codedeps, `kept`) for the next; an
    edited source is parsed again, so a new import is followed, and a torn file is ignored."""
    pkg = _package(
        tmp_path, {"__init__.py": "", "one.py": "from . import two\n", "two.py": "", "three.py": ""}
    )
    script, kept = tmp_path / "script.py", tmp_path / "kept"
    script.write_text("import stagetrain.one\n")

    def reached(kept: Path | None) -> list[str]:
        """What a fresh process (as each Snakemake command is) finds, given only the kept folder."""
        find = "import sys; from pathlib import Path; from stagetrain.workflow.codedeps import modules_of; "
        find += "print(*(p.name for p in modules_of(*map(Path, sys.argv[1:]))))"
        args = [str(script), str(tmp_path), *([str(kept)] if kept else [])]
        out = subprocess.run(
            [sys.executable, "-c", find, *args], capture_output=True, text=True, check=True
        )
        return out.stdout.split()

    assert reached(None) == reached(kept) == ["__init__.py", "one.py", "two.py"]
    assert len(list(kept.glob("*.json"))) == 4  # the script and the three sources it reached
    assert reached(kept) == ["__init__.py", "one.py", "two.py"]
    (pkg / "two.py").write_text("from . import three\n")
    assert reached(kept) == ["__init__.py", "one.py", "three.py", "two.py"]
    for torn in kept.glob("*.json"):
        torn.write_text("[")
    assert reached(kept) == ["__init__.py", "one.py", "three.py", "two.py"]


def test_the_weights_hash_does_not_depend_on_the_sharding(tmp_path: Path) -> None:
    tensors = {
        f"layer.{i}.weight": torch.full((64, 64), float(i), dtype=torch.bfloat16) for i in range(4)
    }
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}

    def chunks(name: str) -> Iterator[torch.Tensor]:
        yield tensors[name]

    hashes = []
    for max_bytes in (10**9, 9000):
        folder = tmp_path / str(max_bytes)
        folder.mkdir()
        write_shards(sorted(tensors), shapes, torch.bfloat16, chunks, folder, max_bytes)
        hashes.append(weights_sha256(sorted(folder.glob("*.safetensors"))))
    assert len(list((tmp_path / "9000").glob("*.safetensors"))) == 4
    assert hashes[0] == hashes[1]
    tensors["layer.3.weight"] = tensors["layer.3.weight"] + 1
    folder = tmp_path / "changed"
    folder.mkdir()
    write_shards(sorted(tensors), shapes, torch.bfloat16, chunks, folder, 10**9)
    assert weights_sha256(sorted(folder.glob("*.safetensors"))) != hashes[0]


def _reached(script: str) -> set[str]:
    """The package modules a stage script's code digest covers, relative to the package."""
    package = REPO / "src" / "stagetrain"
    found = modules_of(REPO / "scripts" / f"{script}.py", REPO / "src")
    return {str(p.relative_to(package)) for p in found}


def test_a_stage_digests_the_types_it_reads_not_the_code_that_writes_them() -> None:
    """The artifacts' types sit in small modules of their own (corpus/meta, consolidate/manifest,
    training/summary, pretrain/summary, grpo/summary), so reading another stage's artifact does
    not put that stage's code into the reader's digest, and edits there do not rerun it. (The
    GRPO settings check builds the tree's class, so every stage that reads settings reaches
    grpo/tree.)"""
    shared = ("grpo/__init__.py", "grpo/tree.py")
    stages = ("tokenizer/", "pretrain/", "grpo/", "consolidate/", "evaluate/", "publish/")
    own = {"pretrain": ("pretrain/",), "grpo": ("grpo/", "consolidate/__init__.py",
           "consolidate/manifest.py", "evaluate/__init__.py", "evaluate/heldout.py"),
           "consolidate": ("consolidate/",),
           "publish": ("publish/", "consolidate/__init__.py", "consolidate/manifest.py",  # what it pushes
                       "pretrain/__init__.py", "pretrain/summary.py", "grpo/summary.py",
                       "grpo/curriculum.py",  # the curriculum's record, in GRPO's summary
                       "evaluate/__init__.py", "evaluate/heldout.py")}  # fmt: skip
    for script, allowed in own.items():
        foreign = {
            m for m in _reached(script)
            if m.startswith(stages) and not m.startswith(allowed) and m not in shared
        }  # fmt: skip
        assert foreign == set(), script
    assert not {m for m in _reached("publish") if m.startswith("training/") and m != "training/summary.py" and not m.endswith("__init__.py")}  # fmt: skip
