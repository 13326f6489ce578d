"""The `publish` target: the consolidated models, a model card and the run's measured layouts,
pushed to a hub repo in one commit.

What a run hands back to the hub: the GRPO model at the repo's root (the pipeline's product) and
the pretrained one under `pretrain/`; a model card (`publish.card`: how to use them and how they
were made, from the run's own records) in place of the GRPO folder's own README.md; and
`parallelism_data.json`, Psyche's table (GPU key -> GPU count -> {dp, tp, micro_batch_size}),
with the layout this run trained with merged over the entries the repo already has, so that the
next run planned on the same GPUs (`parallelism.table_repo`) starts from a layout that ran. Only
layouts that ran to completion are written, and only GPU ones: a CPU run writes none and says so.

Everything goes in one `create_commit`, so a push that fails leaves the repo as it was. The token
is huggingface_hub's to find (HF_TOKEN, the cached login); nothing here reads or writes it.

What leaves a model folder is what its MANIFEST.json lists, and MANIFEST.json itself (the hashes
a downloader checks the files against), each file hashed again first (`listed_files`): a stray
file, a symlink (whose target could be anything, a secrets file), a file missing or changed since
consolidation refuses the push in one line naming them. Snakemake's own marker in a folder it
made (`.snakemake_timestamp`) is skipped by name, not refused: Snakemake writes it into every
directory output, so refusing it would refuse every run; it is never pushed.

The whole push (create the repo, read the layout table, the commit) holds to one deadline,
STAGETRAIN_HUB_PUSH_TIMEOUT_S seconds (`stagetrain.hub.deadline`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from stagetrain.consolidate.manifest import MANIFEST
from stagetrain.errors import StageError
from stagetrain.hub import HubError, deadline
from stagetrain.io import read_json
from stagetrain.planning.plan import LayoutRecord, PlanRecord, TableEntry
from stagetrain.planning.table import Table

log = logging.getLogger("stagetrain")

TABLE = "parallelism_data.json"
CPU = "cpu"
SNAKEMAKE_MARKERS = frozenset({".snakemake_timestamp"})
"""What Snakemake writes into a directory output it made: skipped, never pushed."""


class PublishReceipt(TypedDict):
    """publish.json: where the one commit went, the files in it, and the table pushed (None
    when the run measured no GPU layout)."""

    repo: str
    revision: str
    commit: str
    url: str
    files: list[str]
    table: Table | None


def measured_layouts(plan: PlanRecord, layout: LayoutRecord) -> Table:
    """This run's entry of Psyche's table, from the plan's devices and the layout a finished
    training stage ran (its summary's): {gpu key: {gpu count: {dp, tp, micro_batch_size}}};
    {} on CPU ranks."""
    if plan["device"] == CPU:
        return {}
    entry = TableEntry(
        dp=layout["dp"], tp=layout["tp"], micro_batch_size=layout["micro_batch_size"]
    )
    return {plan["device"]: {str(plan["world"]): entry}}


def merged(existing: Mapping[str, Any], ours: Table) -> Table:
    """`ours` over `existing`, entry by entry (another GPU or count of the repo's is kept).
    `existing` is the repo's file as JSON gives it, kept as found where it is not ours."""
    out = {gpu: dict(counts) for gpu, counts in existing.items() if isinstance(counts, Mapping)}
    for gpu, counts in ours.items():
        out.setdefault(gpu, {}).update(counts)
    return out


def listed_files(folder: Path) -> list[Path]:
    """The files of `folder` to push: those its MANIFEST.json lists, each with the sha256 and size
    recorded there, then MANIFEST.json.

    Raises:
        StageError: one line naming every symlink, file the manifest does not list, listed file
            missing, or file whose bytes changed; nothing is pushed.
    """
    manifest_path = folder / MANIFEST
    if manifest_path.is_symlink():
        raise StageError(f"{manifest_path}: a symlink; publish pushes no symlink")
    manifest = read_json(manifest_path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        raise StageError(
            f"{manifest_path}: expected `files`, an object of file name -> {{sha256, bytes}}"
        )
    present = {p.name: p for p in folder.iterdir() if p.name not in SNAKEMAKE_MARKERS}
    problems = [
        ("symlinks", sorted(n for n, p in present.items() if p.is_symlink())),
        ("not in MANIFEST.json", sorted(n for n, p in present.items()
                                        if n not in files and n != MANIFEST and not p.is_symlink())),
        ("listed but missing", sorted(n for n in files if n not in present)),
    ]  # fmt: skip
    if not any(names for _, names in problems):
        problems.append(
            ("changed since consolidation (sha256)",
             sorted(n for n in files if not _matches(present[n], files[n]))),
        )  # fmt: skip
    found = "; ".join(f"{what}: {', '.join(names)}" for what, names in problems if names)
    if found:
        raise StageError(
            f"{folder}: refused, publish pushes exactly what {MANIFEST} lists ({found}); "
            "rerun consolidate (snakemake --forcerun consolidate) or remove the files"
        )
    return [present[n] for n in sorted(files)] + [manifest_path]


def _matches(path: Path, entry: Mapping[str, Any]) -> bool:
    """Whether `path` holds the bytes a manifest entry records (size first: no hash needed)."""
    if path.stat().st_size != entry.get("bytes"):
        return False
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest() == entry.get("sha256")


def push(*, repo: str, revision: str, private: bool, models: Mapping[str, Path], card: str,
         layouts: Table) -> PublishReceipt:  # fmt: skip
    """One commit to `repo`: the models (`grpo` at the root, the others under their stage's
    folder; each the files its manifest lists, `listed_files`), README.md and, when this run
    measured a GPU layout, the merged table; all within STAGETRAIN_HUB_PUSH_TIMEOUT_S.

    Raises:
        StageError: one line when a folder is not as its manifest says (nothing is pushed), when
            the hub refuses, does not answer in time or cannot be reached, or when its layout
            table is not a JSON object; the repo is as it was.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    operations = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode())]
    for stage, folder in models.items():
        prefix = "" if stage == "grpo" else f"{stage}/"
        operations += [CommitOperationAdd(path_in_repo=f"{prefix}{f.name}", path_or_fileobj=str(f))
                       for f in listed_files(Path(folder))
                       if f"{prefix}{f.name}" != "README.md"]  # the root's card is the run's  # fmt: skip
    where = f"publish: pushing to {repo}@{revision} failed, the repo is as it was"
    api = HfApi()
    try:
        with deadline(where):
            api.create_repo(repo, private=private, exist_ok=True)
            table = _table(repo, revision, layouts, where) if layouts else None
            if table is not None:
                operations.append(CommitOperationAdd(path_in_repo=TABLE, path_or_fileobj=json.dumps(table, indent=2, sort_keys=True).encode()))  # fmt: skip
            info = api.create_commit(repo, operations=operations, revision=revision,
                                     commit_message="stagetrain: models, model card and measured layouts")  # fmt: skip
    except HubError as err:
        raise StageError(str(err)) from None
    except (_hub_errors(), OSError, ValueError) as err:
        if isinstance(err, StageError):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"{where}: {first}") from None
    return PublishReceipt(repo=repo, revision=revision, commit=info.oid, url=info.commit_url,
                          files=sorted(op.path_in_repo for op in operations), table=table)  # fmt: skip


def _hub_errors() -> type[Exception]:
    """The hub's refusals (HTTP errors), imported only when a push fails: publishing's imports
    stay light until it talks to the hub."""
    from huggingface_hub.errors import HfHubHTTPError

    errors: type[Exception] = HfHubHTTPError  # Any to the type check, which skips huggingface_hub
    return errors


def _table(repo: str, revision: str, layouts: Table, where: str) -> Table:
    """This run's layouts merged over the repo's table (none yet: {}).

    Raises:
        StageError: the repo's table is not JSON, or not an object of GPU -> count -> layout.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        raw = Path(hf_hub_download(repo, TABLE, revision=revision)).read_bytes()
    except (EntryNotFoundError, RevisionNotFoundError):
        return merged({}, layouts)
    try:
        existing = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
        raise StageError(f"{where}: its {TABLE} is not valid JSON ({err})") from None
    if not isinstance(existing, dict):
        raise StageError(
            f"{where}: its {TABLE} is not a JSON object (GPU -> GPU count -> layout) but a "
            f"{type(existing).__name__}"
        )
    return merged(existing, layouts)
