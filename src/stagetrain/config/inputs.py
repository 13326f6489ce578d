"""The local files a config makes the stages read, resolved when Snakemake builds the DAG.

Snakemake reruns a job when a declared input changes, so every file a stage
reads must be declared: the parallelism table, the corpus globs, the task
files and reward files, a local tokenizer and a local init_from model. A hub id is not a file
and yields nothing. A local path that names nothing is one line naming its key
here, before any job runs, instead of a failure deep inside a stage.
"""

from __future__ import annotations

import glob
from pathlib import Path

from stagetrain.config.settings import Settings
from stagetrain.errors import StageError
from stagetrain.tasks.rewards import check_function

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def looks_local(value: str) -> bool:
    """Whether `value` names a local path rather than a hub id (namespace/name, at most one '/')."""
    return (
        Path(value).exists()
        or value.startswith(("/", ".", "~"))
        or value.endswith("/")
        or value.count("/") > 1
    )


def refuse_misspelt_folder(key: str, value: str) -> None:
    """A hub id whose namespace is a local folder here is far likelier a misspelt local path
    (`models/my-modell`) than a repository: taken for a hub id, a network would fetch someone
    else's. Such a value must say which it is."""
    namespace = value.split("/", 1)[0]
    if not looks_local(value) and "/" in value and Path(namespace).is_dir():
        raise StageError(
            f"config: {key}: {value!r} is not a local folder, so it would be taken for a hub id, "
            f"though {namespace}/ is a folder here: write ./{value} for a local folder (then it must "
            f"exist), or move {namespace}/ away to mean the hub repository"
        )


def _folder_files(key: str, value: str) -> list[str]:
    """Every file under a local folder (or the file itself), sorted."""
    path = Path(value).expanduser()
    if path.is_file():
        return [str(path)]
    if not path.is_dir():
        raise StageError(f"config: {key}: no such file or folder {value!r}")
    files = sorted(str(p) for p in path.rglob("*") if p.is_file())
    if not files:
        raise StageError(f"config: {key}: folder {value!r} holds no file")
    return files


def local_inputs(config: Settings) -> dict[str, list[str]]:
    """The local files each part of `config` names, by kind, each list sorted.

    Kinds: `table` (parallelism.table_path), `data_files` (data.files globs),
    `task_files` (the local files of tasks.families), `reward_files` (their reward functions'
    files, read here without running them: each must define its function, whose parameters
    take TRL's keyword call; a reward of an installed module is imported and its signature
    checked, and is no file of the run), `tokenizer` (a local
    tokenizer.path, read only by a pretrained source), `init_from` (the files of a local model.init_from folder)
    and `init_from_config` (those of them that are not weights).
    """
    found: dict[str, list[str]] = {kind: [] for kind in
                                   ("table", "data_files", "task_files", "reward_files", "tokenizer", "init_from", "init_from_config")}  # fmt: skip
    table = config.parallelism.table_path
    if table:
        if not Path(table).is_file():
            raise StageError(f"config: parallelism.table_path: no such file {table!r}")
        found["table"] = [table]
    files: set[str] = set()
    for index, entry in enumerate(config.data.files):
        matches = [p for p in glob.glob(entry.path, recursive=True) if Path(p).is_file()]
        if not matches:
            raise StageError(f"config: data.files.{index}.path: no file matches {entry.path!r}")
        files.update(matches)
    found["data_files"] = sorted(files)
    tasks, rewards = set(), set()
    for index, family in enumerate(config.tasks.families):
        key = f"tasks.families.{index}"
        for i, file in enumerate(family.files):
            if not isinstance(file, str):
                continue  # a hub file
            matches = [p for p in glob.glob(file, recursive=True) if Path(p).is_file()]
            if not matches:
                raise StageError(f"config: {key}.files.{i}: no file matches {file!r}")
            tasks.update(matches)
        for i, reward in enumerate(family.rewards or ()):
            if "function" in reward:
                where = f"{key}.rewards.{i}.function"
                path = check_function(reward["function"], where, reward.get("kwargs"))
                rewards.update([path] if path else [])  # an installed module is no file of the run
    found["task_files"], found["reward_files"] = sorted(tasks), sorted(rewards)
    tokenizer = config.tokenizer.path
    if config.tokenizer.source == "pretrained" and tokenizer:
        refuse_misspelt_folder("tokenizer.path", tokenizer)
        if looks_local(tokenizer):
            found["tokenizer"] = _folder_files("tokenizer.path", tokenizer)
    init_from = config.model.init_from
    if init_from:
        refuse_misspelt_folder("model.init_from", init_from)
    if init_from and looks_local(init_from):
        found["init_from"] = _folder_files("model.init_from", init_from)
        found["init_from_config"] = [
            f for f in found["init_from"] if not f.endswith(WEIGHT_SUFFIXES)
        ]
    return found
