"""The GRPO stage on the user's own task families, run for real on two CPU ranks.

The families here come from a local parquet file and a jsonl.gz file on the loopback
hub; their reward functions read an extra dataset column and are weighted; the
tokenizer has a chat template. The rewards are chosen to depend only on the problem
(a column of its row), so what each step and each evaluation must report is known
exactly from the prompts the stage drew: the test checks the figures, not only that
the stage ran.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from harness.hub import commit_sha, serve_hub
from harness.training import grpo_config as harness_grpo_config
from harness.training import launch_grpo
from transformers import AutoTokenizer

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import CurriculumSettings, TasksSettings
from stagetrain.grpo.curriculum import Curriculum
from stagetrain.grpo.steps import step_prompts
from stagetrain.tasks import heldout
from stagetrain.tasks.families import load_tasks
from stagetrain.tasks.judge import Judge

pytestmark = pytest.mark.slow
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")  # fmt: skip
REWARDS = '''
def even(prompts, completions, i, **kw):
    """1 for a row whose `i` is even; not applicable (None) to the others."""
    return [1.0 if n % 2 == 0 else None for n in i]


def thirds(prompts, completions, i, **kw):
    """1 for a row whose `i` divides by 3, else 0; raises on the row RAISE_ON names."""
    if RAISE_ON in prompts:
        raise ValueError("a row it cannot score")
    return [float(n % 3 == 0) for n in i]


RAISE_ON = None
'''


def expected_reward(i: int) -> float:
    """What the weighted rewards below give a problem whose row has `i`."""
    return 2.0 * (i % 2 == 0) + 0.5 * (i % 3 == 0)


def rows(name: str, n: int = 1200) -> list[dict[str, Any]]:
    return [
        {"question": f"{name} {i}?", "solution": str(i), "difficulty": 1 + i % 2, "i": i}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def start(
    data: dict[str, str], scoring_start: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, str], str]:
    """The shared data with a chat-templated copy of its tokenizer, and the scoring start model."""
    root = tmp_path_factory.mktemp("grpo-tasks")
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "chat-tokenizer")
    return {**data, "tokenizer": str(root / "chat-tokenizer")}, scoring_start


def local_tasks(root: Path) -> TasksSettings:
    """`tasks_section` with the remote family's file local, validated, as its settings."""
    return TasksSettings.from_config(stconfig.validate_section("tasks", tasks_section(root, None)))


def tasks_section(root: Path, hub_repo: str | None) -> dict[str, Any]:
    """Two families with weighted rewards: parity from a local parquet file, remote from a jsonl.gz
    file of the loopback hub (`hub_repo`; None: a local copy of the same file, for this process,
    whose hub client was set up before the loopback hub started)."""
    pq.write_table(pa.Table.from_pylist(rows("parity")), root / "parity.parquet")
    (root / "remote.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in rows("remote")).encode())
    )
    remote = (
        {"repo": hub_repo, "file": "data/remote.jsonl.gz"}
        if hub_repo
        else str(root / "remote.jsonl.gz")
    )
    (root / "rewards.py").write_text(REWARDS)
    weighted = [{"function": f"{root / 'rewards.py'}:even", "weight": 2.0},
                {"function": f"{root / 'rewards.py'}:thirds", "weight": 0.5}]  # fmt: skip
    columns = {"prompt": "question", "answer": "solution", "level": "difficulty"}
    return {
        "families": [
            {"name": "parity", "files": [str(root / "parity.parquet")], "columns": columns, "rewards": weighted,
             "success_at": 2.5},  # solved: both terms, an i that divides by 6
            {"name": "remote", "files": [remote], "columns": columns, "rewards": weighted, "success_at": 2.5},
        ],
    }  # fmt: skip


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    body = gzip.compress("".join(json.dumps(r) + "\n" for r in rows("remote")).encode())
    sha = commit_sha("remote-tasks")
    with serve_hub(
        {"datasets/org/tasks": {"main": (sha, {"data/remote.jsonl.gz": body})}}
    ) as server:
        for key in ("HF_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("STAGETRAIN_WINDOW_LOG", "1")
        yield server, sha


def config(tasks: dict[str, Any], **grpo: Any) -> dict[str, Any]:
    """The GRPO config of these tests with `tasks` as its section, validated (defaults filled),
    as the stage gets it."""
    cfg = harness_grpo_config(**{"curriculum": {"families": ["parity", "remote"]}, "steps": 2, "eval_every": 2,
                                 "checkpoint_every": 1, "max_prompt_len": 48, **grpo})  # fmt: skip
    return {**cfg, "tasks": stconfig.validate_section("tasks", tasks)}


def test_grpo_trains_on_own_families_with_their_rewards_and_template(
    start: tuple, tmp_path: Path, hub: Any
) -> None:
    data, model = start
    _, sha = hub
    tasks = tasks_section(tmp_path, "org/tasks")
    cfg = config(tasks)
    proc = launch_grpo(
        data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 2}, cfg=cfg
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    # Read, checked and sampled by one rank of the host, not by each (training.host).
    loads = [
        line.split(":")[0] for line in proc.stdout.splitlines() if "problems at levels" in line
    ]
    assert sorted(loads) == ["task family parity", "task family remote"], proc.stdout[-3000:]
    loaded = load_tasks(local_tasks(tmp_path))
    problems = {
        p.key: p
        for f in ("parity", "remote")
        for ps in loaded.families[f].family.pool.values()
        for p in ps
    }
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    judge = Judge(loaded, tokenizer, max_prompt_len=48)
    records = {
        r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    }
    (folder,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    drawn = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    for entry in drawn:
        step = records[entry["step"]]
        expected = [expected_reward(problems[k].columns["i"]) for k in entry["prompts"]]
        assert step["reward/mean"] == pytest.approx(sum(expected) / len(expected))
        for key, ids in zip(entry["prompts"], entry["prompt_ids"], strict=True):
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": problems[key].question}],
                                                     add_generation_prompt=True, tokenize=True)["input_ids"]  # fmt: skip
            assert ids == list(rendered) == judge.prompt_ids(problems[key])
    assert {problems[k].family for e in drawn for k in e["prompts"]} == {"parity", "remote"}
    # Each term by its function's name, unweighted, None rows left out (TRL's rewards/<name>/mean).
    for entry in drawn:
        i = [problems[k].columns["i"] for k in entry["prompts"]]
        logged = records[entry["step"]]["rewards"]
        evens = [n for n in i if n % 2 == 0]
        assert logged["thirds"]["mean"] == pytest.approx(sum(n % 3 == 0 for n in i) / len(i))
        assert ("even" in logged) == bool(evens) and logged.get("even", {}).get("mean", 1.0) == 1.0
    # held-out: solved = i divides by 6 (weighted >= 2.5)
    for moment in ("start_by_family", "end_by_family"):
        for family in ("parity", "remote"):
            held = heldout(family, 1, cfg["grpo"]["eval_problems"], seed=cfg["run"]["seed"])
            assert summary["accuracy"][moment][family] == pytest.approx(
                sum(p.columns["i"] % 6 == 0 for p in held) / len(held)
            )
    assert summary["tasks"]["remote"]["files"] == [
        {"hub": "org/tasks/data/remote.jsonl.gz@main", "commit": sha}
    ]
    assert summary["tasks"]["parity"]["files"] == [{"path": str(tmp_path / "parity.parquet")}]
    # The evaluation script, on the start model, scores the families through the same rewards.
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"tasks": tasks, "grpo": {"max_prompt_len": 48}})
    )
    proc = subprocess.run([sys.executable, "-m", "stagetrain.evaluate", model, "--config", str(tmp_path / "config.yaml"),
                           "--families", "parity", "remote", "--levels", "1", "--json", str(tmp_path / "eval.json")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "eval.json").read_text())
    for family in ("parity", "remote"):
        held = heldout(family, 1, 278, seed=1234)
        assert doc["accuracy"][family]["1"]["accuracy"] == pytest.approx(
            sum(p.columns["i"] % 6 == 0 for p in held) / len(held)
        )
        assert doc["accuracy"][family]["1"]["problems"] == len(held)


def test_a_raising_reward_stops_before_the_step_and_keeps_the_last_checkpoint(
    start: tuple, tmp_path: Path, hub: Any
) -> None:
    """The row the function raises on is drawn at step 2, not at step 1 (the draws are a pure
    function of seed, step and curriculum), so step 1 is saved and step 2 must not be."""
    data, model = start
    tasks = tasks_section(tmp_path, "org/tasks")
    cfg = config(tasks)
    load_tasks(local_tasks(tmp_path))
    curriculum = CurriculumSettings.from_config(cfg["grpo"]["curriculum"], "grpo.curriculum")
    state = Curriculum.start(curriculum, ["parity", "remote"])
    first, second = (step_prompts(state, curriculum, prompts=cfg["grpo"]["prompts_per_step"], seed=cfg["run"]["seed"], step=s)
                     for s in (1, 2))  # fmt: skip
    culprit = next(
        p for p in second if p.key not in {q.key for q in first} and p.family == "parity"
    )
    (tmp_path / "rewards.py").write_text(
        REWARDS.replace("RAISE_ON = None", f"RAISE_ON = {culprit.question!r}")
    )
    proc = launch_grpo(
        data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 2}, cfg=cfg
    )
    assert proc.returncode != 0
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    assert errors == {f"error: reward {tmp_path / 'rewards.py'}:thirds: raised ValueError: a row it cannot score on the "
                      f"row ({culprit.origin}) with prompt {culprit.question!r}"}, proc.stderr[-3000:]  # fmt: skip
    (folder,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    assert json.loads((folder / "latest.json").read_text())["step"] == 1
    assert not (tmp_path / "summary.json").exists()
    shutil.rmtree(tmp_path / "checkpoints")


def test_a_prompt_too_long_as_rendered_stops_before_the_engines(
    start: tuple, tmp_path: Path, hub: Any
) -> None:
    """With the chat template a parity prompt is longer than max_prompt_len: cut, it would ask
    another question than its reward checks. One line naming the row, before any step."""
    data, model = start
    tasks = tasks_section(tmp_path, "org/tasks")
    cfg = config(tasks, max_prompt_len=8)
    proc = launch_grpo(
        data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 2}, cfg=cfg
    )
    assert proc.returncode != 0
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, proc.stderr[-3000:]
    (line,) = errors
    assert (
        line.startswith(f"error: {tmp_path / 'parity.parquet'}:row ")
        and "tokens with the chat template, more than grpo.max_prompt_len (8)" in line
    ), line
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()


TRL_REWARDS = '''
def reward_len(completions, **kwargs):
    """TRL's GRPOTrainer docs' example reward, as written there."""
    return [-abs(20 - len(completion)) for completion in completions]


async def longer(completions, **kwargs):
    """An async reward, which TRL awaits."""
    return [len(completion) / 10 for completion in completions]
'''


def test_trls_own_rewards_and_datasets_run_through_the_stage_unchanged(
    start: tuple, tmp_path: Path
) -> None:
    """TRL's shipped rewards (a conversational family with a `solution` column; a factory with
    kwargs), the docs' `reward_len` and an async function, on files as `datasets` writes them:
    each term the completions table logs is what TRL's function gives, called here directly on
    the logged completion; the weighted sum and the per-reward metrics follow from them."""
    import asyncio
    import importlib.util

    from datasets import Dataset
    from trl.rewards import accuracy_reward, get_repetition_penalty_reward, think_format_reward

    data, model = start
    chat = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}], "solution": str(i + 1),
             "difficulty": 1 + i % 2} for i in range(1200)]  # fmt: skip
    Dataset.from_list(chat).to_json(tmp_path / "chat.json")  # JSON lines, TRL's usual file
    Dataset.from_list(rows("plain")).to_json(tmp_path / "plain.json")
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    own = tmp_path / "trl_rewards.py"
    tasks = {"families": [
        {"name": "chat", "files": [str(tmp_path / "chat.json")],
         "columns": {"prompt": "prompt", "answer": "solution", "level": "difficulty"},
         "rewards": [{"function": "trl.rewards:accuracy_reward"},
                     {"function": "trl.rewards:think_format_reward", "weight": 0.5}]},
        {"name": "plain", "files": [str(tmp_path / "plain.json")],
         "columns": {"prompt": "question", "answer": "solution", "level": "difficulty"},
         "rewards": [{"function": "trl.rewards:get_repetition_penalty_reward", "kwargs": {"ngram_size": 2}},
                     {"function": f"{own}:reward_len", "weight": 0.1},
                     {"function": f"{own}:longer", "weight": 0.2}],
         "success_at": 0.5},
    ]}  # fmt: skip
    cfg = config(tasks, curriculum={"families": ["chat", "plain"]}, log_completions_every=1)
    proc = launch_grpo(
        data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 2}, cfg=cfg
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    spec = importlib.util.spec_from_file_location("trl_rewards", own)
    assert spec and spec.loader
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    repetition = get_repetition_penalty_reward(ngram_size=2)
    table = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    per_step = cfg["grpo"]["prompts_per_step"] * cfg["grpo"]["group_size"]
    assert len(table) == cfg["grpo"]["steps"] * per_step
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    solutions = {tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False): r["solution"]
                 for r in chat}  # fmt: skip
    weights = {"chat": {"accuracy_reward": 1.0, "think_format_reward": 0.5},
               "plain": {"repetition_penalty_reward": 1.0, "reward_len": 0.1, "longer": 0.2}}  # fmt: skip
    for row in table:
        text, ids = row["completion"], row["completion_ids"]
        if row["family"] == "chat":
            message = [[{"role": "assistant", "content": text}]]
            extra: dict[str, list[Any]] = {}
            expected = {
                "accuracy_reward": accuracy_reward(
                    completions=message, solution=[solutions[row["prompt"]]],
                    log_extra=lambda column, values, sink=extra: sink.setdefault(column, []).extend(values),
                )[0],
                "think_format_reward": think_format_reward(completions=message)[0],
            }  # fmt: skip
            assert row["extra"] == {column: values[0] for column, values in extra.items()} != {}
        else:
            expected = {
                "repetition_penalty_reward": repetition(completion_ids=[ids])[0],
                "reward_len": user.reward_len(completions=[text])[0],
                "longer": asyncio.run(user.longer(completions=[text]))[0],
            }
        assert row["rewards"] == pytest.approx(expected), row
        assert row["reward"] == pytest.approx(
            sum(weights[row["family"]][k] * (v or 0.0) for k, v in expected.items())
        )
    assert len({row["rewards"]["reward_len"] for row in table if row["family"] == "plain"}) > 1
    assert any(
        row["rewards"]["repetition_penalty_reward"] < 0 for row in table if row["family"] == "plain"
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in (r for r in records if "rewards" in r):  # TRL's rewards/<name>/mean, of the table
        for name, logged in record["rewards"].items():
            values = [row["rewards"][name] for row in table
                      if row["step"] == record["step"] and row["rewards"].get(name) is not None]  # fmt: skip
            assert logged["mean"] == pytest.approx(sum(values) / len(values)), (
                record["step"],
                name,
            )
    page = (tmp_path / "completions.html").read_text()
    assert "<th>think_format_reward</th>" in page and "<th>longer</th>" in page
