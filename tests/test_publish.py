"""The `publish` target against the loopback hub (harness.hub, which takes commits): both models,
the model card and the measured layouts in one commit, a table the next plan starts from, and a
refused push that changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.configs import edit_config
from harness.hub import DEFAULT_TOKEN, commit_sha, hub_call, serve_hub
from harness.workflow import snakemake

from stagetrain.config import validation as stconfig
from stagetrain.tasks.problem import ANSWER_TOKEN, PROBLEM_TOKEN

pytestmark = pytest.mark.slow
REPO = "me/tiny-model"
OTHER_GPU = {"A100-80GB": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 2}}}


def test_publish_pushes_both_models_and_a_card_in_one_commit(
    finished_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = finished_copy
    start = commit_sha("start")
    with serve_hub({REPO: {"main": (start, {"notes.txt": b"kept\n"})}}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        edit_config(workdir, "publish", repo=REPO, license="mit")
        evaluation = {
            "accuracy": {
                "comparison": {"1": {"accuracy": 0.625, "se": 0.05, "problems": 40, "distinct": 40}}
            }
        }
        (workdir / "results/tiny/evaluate").mkdir()  # as the `evaluate` target leaves it
        (workdir / "results/tiny/evaluate/grpo.json").write_text(json.dumps(evaluation))
        proc = snakemake(workdir, "publish")
        receipt = json.loads((workdir / "results/tiny/publish.json").read_text())
        sha, files = hub.repos[REPO]["main"]
        assert receipt["commit"] == sha != start
        commits = [r for r in hub.requests if r.method == "POST" and "/commit/" in r.path]
        assert len(commits) == 1  # one commit: a failure half-way cannot leave half a push
        for folder, prefix in (("grpo", ""), ("pretrain", "pretrain/")):
            model = workdir / "results/tiny/model" / folder
            listed = [*json.loads((model / "MANIFEST.json").read_text())["files"], "MANIFEST.json"]
            for name in listed:  # the GRPO folder's own card gives way to the run's at the root
                if prefix + name != "README.md":
                    assert files[prefix + name] == (model / name).read_bytes()
            assert "README.md" in listed  # the folder's own card, in its manifest
            stops = json.loads(files[prefix + "generation_config.json"])["eos_token_id"]
            assert isinstance(stops, list) and len(stops) == 2  # eos and the next problem's marker
        assert not [f for f in files if ".snakemake" in f or f.endswith(".log")]
        # exactly what the manifests list, the card and the repo's own file: no Snakemake marker
        assert sorted(files) == sorted({*receipt["files"], "notes.txt"})
        assert files["notes.txt"] == b"kept\n"
        card = files["README.md"].decode()
        assert "library_name: transformers" in card and "stagetrain" in card
        assert "| comparison | 1 |" in card  # the held-out accuracy before and after GRPO
        assert_card_tells_the_run(card, workdir)
        assert "| grpo | comparison | 1 | 0.625 | 0.050 | 40 |" in card  # the evaluate target's
        # On CPU ranks no GPU layout was measured: no table, and the log says so.
        assert "parallelism_data.json" not in files and receipt["table"] is None
        assert "measures no GPU layout" in proc.stdout + proc.stderr
        written = [p.read_bytes() for p in (workdir / "results").rglob("*") if p.is_file()]
        assert not any(DEFAULT_TOKEN.encode() in data for data in written)

        hub.refuse_commits = True
        proc = snakemake(workdir, "publish", "--forcerun", "publish", check=False)
        assert proc.returncode != 0
        line = (workdir / "results/tiny/logs/publish.log").read_text().strip().splitlines()[-1]
        assert line.startswith(
            f"error: publish: pushing to {REPO}@main failed, the repo is as it was: "
        )
        assert hub.repos[REPO]["main"] == (sha, files)
        assert not (workdir / "results/tiny/publish.json").exists()


def assert_card_tells_the_run(card: str, workdir: Path) -> None:
    """Every item the card owes, checked against the run's own files: the license, the usage
    (both models, the prompt markup), each corpus source's files, weight and tokens, each
    curriculum family and the level it reached, the GRPO settings and the tokens generated."""
    results = workdir / "results/tiny"
    config = stconfig.load(workdir / "config/config.yaml")
    grpo, summary = config["grpo"], json.loads((results / "grpo/summary.json").read_text())
    assert "license: mit" in card.split("---")[1]
    assert 'from_pretrained(repo, subfolder="pretrain")' in card and "from_pretrained(repo)" in card
    assert f"{PROBLEM_TOKEN}12+34{ANSWER_TOKEN}" in card
    # Its trained tokenizer's template renders the markup, so the card says both ways work.
    assert "Prompts are the pipeline's own markup" in card
    assert "The tokenizer's chat template renders the same markup" in card
    for source in json.loads((results / "data/meta.json").read_text())["sources"]:
        line = next(
            x
            for x in card.splitlines()
            if x.startswith("- ") and f"{source['train_tokens']:,} training tokens" in x
        )
        assert f"weight {source['weight']:g}" in line
        assert all(
            f"`{f}`" in line for f in source["record"].get("files", []) if isinstance(f, str)
        )
    for family in grpo["curriculum"]["families"]:
        assert f"| {family} | " in card and f" | {summary['curriculum'][family]['level']} |" in card
    generated = sum(json.loads(x).get("rollout/generated_tokens", 0)
                    for x in (results / "grpo/metrics.jsonl").read_text().splitlines() if x.strip())  # fmt: skip
    assert generated > 0
    assert (f"loss `{grpo['loss_type']}`, group size {grpo['group_size']}, KL coefficient {grpo['kl_coef']:g}, "
            f"{grpo['prompts_per_step']} prompts per step, {summary['final_step']} steps") in card  # fmt: skip
    assert f"completion tokens generated: {generated:,}." in card


def test_publish_without_a_repo_fails_the_dry_run_in_one_line(workdir: Path) -> None:
    """Decided as the DAG is built: no job runs (a fresh workflow, nothing detected yet)."""
    proc = snakemake(workdir, "-n", "publish", check=False, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert errors == [
        "error: publish.repo: expected the hub repo to push to (namespace/name); none is set, "
        "so the publish target cannot run"
    ]
    assert "Traceback" not in proc.stderr and not (workdir / "results").exists()


PUSH = """
import hashlib, json, sys
from pathlib import Path
from stagetrain.publish.push import measured_layouts, push
folder = Path(sys.argv[1])
folder.mkdir()
(folder / "config.json").write_text("{}")
listed = {"config.json": {"sha256": hashlib.sha256(b"{}").hexdigest(), "bytes": 2}}
(folder / "MANIFEST.json").write_text(json.dumps({"files": listed}))
plan = {"device": "H100", "world": 8}
summary = {"layout": {"dp": 8, "tp": 1, "micro_batch_size": 4}}
receipt = push(repo="me/tables", revision="main", private=False, models={"grpo": folder},
               card="---\\nlibrary_name: transformers\\n---\\n", layouts=measured_layouts(plan, summary["layout"]))
print(json.dumps(receipt))
"""
PLAN = """
import json
from stagetrain.config import validation as stconfig
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.planning.resolve import table_values
from stagetrain.planning.search import Devices
from stagetrain.config.settings import ParallelismSettings
devices = Devices(gpu=gpu_spec("H100"), nodes=1, per_node=8, device_bytes=80 * 2**30,
                  host_bytes_per_node=None, inter_node_gbps=50)
section = {"table_path": None, "table_repo": "me/tables", "table_revision": "main", "on_table_miss": "planner"}
parallelism = ParallelismSettings.from_config(stconfig.validate_section("parallelism", section))
print(json.dumps(list(table_values(parallelism, None, devices))))
"""


def test_a_published_table_is_what_the_next_plan_starts_from(tmp_path: Path) -> None:
    """A GPU run's layout, merged over the repo's entries for other GPUs, is found by the next
    plan on the same GPUs, which records the commit it came from."""
    table = json.dumps(OTHER_GPU).encode()
    with serve_hub(
        {"me/tables": {"main": (commit_sha("t"), {"parallelism_data.json": table})}}
    ) as hub:
        receipt = hub_call(
            tmp_path, hub.endpoint, [str(tmp_path / "model")], code=PUSH, token=DEFAULT_TOKEN
        )
        assert receipt["table"] == {
            **OTHER_GPU,
            "H100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 4}},
        }
        values, record = hub_call(tmp_path, hub.endpoint, [], code=PLAN, cache=tmp_path / "next")
    assert values == {"dp": 8, "tp": 1, "micro_batch_size": 4}
    assert record["status"] == "used" and record["source"] == f"hub:me/tables@{receipt['commit']}"
