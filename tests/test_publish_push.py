"""`publish.push` against the loopback hub, without a pipeline run: a model folder leaves as exactly
what its MANIFEST.json lists (re-hashed), and every hub failure, a silent hub included, is one line
within STAGETRAIN_HUB_PUSH_TIMEOUT_S."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
from harness.hub import DEFAULT_TOKEN, closed_port, commit_sha, hub_call, serve_hub, silent_hub

from stagetrain.publish.card import source_line
from stagetrain.publish.push import merged

REPO = "me/tiny-model"
FILES = {"config.json": b"{}\n", "model-00001-of-00001.safetensors": b"weights" * 100}
PUSH = """
import json, sys
from pathlib import Path
from stagetrain.errors import StageError
from stagetrain.publish.push import push
layouts = json.loads(sys.argv[2])
try:
    receipt = push(repo="me/tiny-model", revision="main", private=False,
                   models={"grpo": Path(sys.argv[1])}, card="---\\nlicense: mit\\n---\\n", layouts=layouts)
except StageError as err:
    print(json.dumps({"error": str(err)}))
else:
    print(json.dumps(receipt))
"""
GPU_LAYOUT = {"H100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 4}}}


def model_folder(root: Path, listed: dict[str, bytes] = FILES) -> Path:
    """A consolidated folder as consolidate leaves it: the files, their MANIFEST.json, and the
    timestamp Snakemake writes into a directory output."""
    folder = root / "model"
    folder.mkdir()
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    listed = {
        n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for n, d in FILES.items()
    }
    (folder / "MANIFEST.json").write_text(json.dumps({"files": listed}))
    (folder / ".snakemake_timestamp").write_text("")
    return folder


def pushed(tmp_path: Path, endpoint: str, folder: Path, layouts: object = None,
           env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """push()'s receipt, or {"error": its one-line StageError}, from a fresh interpreter."""
    return hub_call(tmp_path, endpoint, [str(folder), json.dumps(layouts or {})], code=PUSH,
                    token=DEFAULT_TOKEN, env=env)  # fmt: skip


def test_a_folder_leaves_as_its_manifest_lists_it_and_no_marker(tmp_path: Path) -> None:
    """The GRPO folder's own README.md (listed) gives way to the run's card at the root."""
    folder = model_folder(tmp_path, {**FILES, "README.md": b"the folder's own card"})
    with serve_hub({}) as hub:
        receipt = pushed(tmp_path, hub.endpoint, folder)
        _, files = hub.repos[REPO]["main"]
    assert sorted(files) == sorted([*FILES, "MANIFEST.json", "README.md"]) == receipt["files"]
    assert all(files[n] == d for n, d in FILES.items())
    assert files["README.md"] == b"---\nlicense: mit\n---\n"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("stray", r"not in MANIFEST\.json: notes\.txt"),
        ("symlink", r"symlinks: secrets\.txt"),
        ("changed", r"changed since consolidation \(sha256\): model-00001-of-00001\.safetensors"),
        ("same size", r"changed since consolidation \(sha256\): model-00001-of-00001\.safetensors"),
        ("missing", r"listed but missing: config\.json"),
        ("log", r"not in MANIFEST\.json: consolidate\.log"),
    ],
)
def test_a_folder_not_as_its_manifest_says_is_refused_in_one_line(
    tmp_path: Path, damage: str, message: str
) -> None:
    """Nothing reaches the hub: the folder is checked before the first request."""
    folder = model_folder(tmp_path)
    shard = folder / "model-00001-of-00001.safetensors"
    if damage == "stray":
        (folder / "notes.txt").write_text("scratch")
    elif damage == "symlink":
        (tmp_path / "secrets").write_text(DEFAULT_TOKEN)
        (folder / "secrets.txt").symlink_to(tmp_path / "secrets")
    elif damage == "changed":
        shard.write_bytes(b"other")
    elif damage == "same size":
        shard.write_bytes(b"W" + shard.read_bytes()[1:])
    elif damage == "missing":
        (folder / "config.json").unlink()
    else:
        (folder / "consolidate.log").write_text("log")
    with serve_hub({}) as hub:
        result = pushed(tmp_path, hub.endpoint, folder)
        assert hub.requests == [] and REPO not in hub.repos
    assert "\n" not in result["error"]
    assert result["error"].startswith(
        f"{folder}: refused, publish pushes exactly what MANIFEST.json lists"
    )
    assert re.search(message, result["error"])


def test_a_hub_that_never_answers_fails_within_the_push_deadline(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    with silent_hub(limit_s=60) as endpoint:
        start = time.monotonic()
        result = pushed(tmp_path, endpoint, folder, env={"STAGETRAIN_HUB_PUSH_TIMEOUT_S": "3"})
        took = time.monotonic() - start
    assert took < 20, took  # the interpreter's start and imports, then 3 s
    assert result["error"].startswith(
        f"publish: pushing to {REPO}@main failed, the repo is as it was: hub unreachable ("
    )
    assert "3 s limit of STAGETRAIN_HUB_PUSH_TIMEOUT_S" in result["error"]
    assert "\n" not in result["error"]


def test_an_unreachable_hub_is_one_line(tmp_path: Path) -> None:
    result = pushed(tmp_path, f"http://127.0.0.1:{closed_port()}", model_folder(tmp_path))
    assert result["error"] == (
        f"publish: pushing to {REPO}@main failed, the repo is as it was: hub unreachable (ConnectError)"
    )


@pytest.mark.parametrize(
    ("table", "reason"),
    [(b"[1, 2]", "is not a JSON object (GPU -> GPU count -> layout) but a list"),
     (b"{not json", "is not valid JSON")],
)  # fmt: skip
def test_a_layout_table_that_is_not_a_json_object_is_one_line(
    tmp_path: Path, table: bytes, reason: str
) -> None:
    start = commit_sha("t")
    with serve_hub({REPO: {"main": (start, {"parallelism_data.json": table})}}) as hub:
        result = pushed(tmp_path, hub.endpoint, model_folder(tmp_path), GPU_LAYOUT)
        assert hub.repos[REPO]["main"][0] == start  # no commit
    assert result["error"].startswith(
        f"publish: pushing to {REPO}@main failed, the repo is as it was: its parallelism_data.json {reason}"
    )
    assert "\n" not in result["error"]


def test_the_card_names_each_corpus_source_by_its_files_weight_and_tokens() -> None:
    """Not "1 local file(s)": each file by name (a hub source at its commit), weight, tokens."""
    files = {"name": "files.0", "weight": 0.25, "train_tokens": 11651, "val_tokens": 0, "train_documents": 3,
             "val_documents": 0, "record": {"kind": "files", "path": "data/*.txt", "weight": 0.25,
                                            "text_field": "text", "files": ["data/a.txt", "data/b.txt"]}}  # fmt: skip
    hub = {**files, "weight": 0.75, "train_tokens": 1200,
           "record": {"kind": "hub", "repo": "org/corpus", "files": ["train.jsonl"], "revision": "main",
                      "weight": 0.75, "text_field": "text", "commit": "c" * 40}}  # fmt: skip
    assert (
        source_line(files)
        == "local files `data/a.txt`, `data/b.txt`: weight 0.25, 11,651 training tokens"
    )
    assert source_line(hub) == (
        f"`org/corpus` at commit `{'c' * 40}` (`train.jsonl`): weight 0.75, 1,200 training tokens"
    )


def test_a_merged_table_keeps_the_repos_other_counts_of_the_same_gpu_and_replaces_ours() -> None:
    """A run on 8 H100s publishes its layout into a table that already holds 4 and 8 H100s
    and an A100: the 4-GPU entry (another run's measurement) and the A100 stay as found, the
    8-GPU entry becomes this run's, and an entry that is no mapping is dropped, not merged."""
    existing = {
        "H100": {
            "4": {"dp": 4, "tp": 1, "micro_batch_size": 2},
            "8": {"dp": 2, "tp": 4, "micro_batch_size": 1},
        },
        "A100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 1}},
        "notes": "kept by hand",
    }
    ours = {"H100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 4}}}
    assert merged(existing, ours) == {
        "H100": {
            "4": {"dp": 4, "tp": 1, "micro_batch_size": 2},
            "8": {"dp": 8, "tp": 1, "micro_batch_size": 4},
        },
        "A100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 1}},
    }
    assert existing["H100"]["8"] == {
        "dp": 2,
        "tp": 4,
        "micro_batch_size": 1,
    }  # not changed in place
