"""Held-out gains with standard errors: the arithmetic, GRPO's summary report and the evaluate CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.configs import model_settings
from harness.contracts import mismatches
from harness.workflow import default_config
from transformers import AutoModelForCausalLM

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import EvaluateSettings
from stagetrain.evaluate import accuracy as evaluate
from stagetrain.evaluate.heldout import TARGET_SE, GainReport, gains, problems_for, standard_error
from stagetrain.grpo.train import held_out_gain
from stagetrain.model.config import build_config
from stagetrain.tasks import problems, training_text
from stagetrain.tokenizer.build import save, train_bpe


def test_the_standard_error_is_the_binomial_one_and_the_default_size_meets_the_target() -> None:
    assert standard_error(0.5, 100) == pytest.approx(0.05)
    assert standard_error(0.0, 10) == 0.0
    n = problems_for()
    assert n == 278  # 0.25 / 0.03^2 = 277.8
    assert standard_error(0.5, n) <= TARGET_SE < standard_error(0.5, n - 1)
    with pytest.raises(ValueError, match="on 0"):
        standard_error(0.5, 0)


def test_gains_per_family_and_level_and_their_mean_at_one_level() -> None:
    start = {
        "comparison": {1: (0.3, 200, 190), 2: (0.1, 200, 200)},
        "counting": {1: (0.8, 100, 16)},
    }
    end = {"comparison": {1: (0.6, 200, 190), 2: (0.1, 200, 200)}, "counting": {1: (0.7, 100, 16)}}
    report = gains(start, end, level=1)
    cmp1 = report["by_family"]["comparison"]["1"]
    assert cmp1["gain"] == pytest.approx(0.30) and cmp1["problems"] == 200
    assert cmp1["distinct"] == 190 and report["by_family"]["counting"]["1"]["distinct"] == 16
    assert cmp1["se"] == pytest.approx(math.sqrt(0.3 * 0.7 / 200 + 0.6 * 0.4 / 200))
    assert report["by_family"]["comparison"]["2"]["gain"] == pytest.approx(0.0)
    mean = report["mean"]
    assert mean["families"] == ["comparison", "counting"] and mean["level"] == 1
    assert mean["gain"] == pytest.approx((0.30 - 0.10) / 2)
    se_counting = math.sqrt(0.8 * 0.2 / 100 + 0.7 * 0.3 / 100)
    assert mean["se"] == pytest.approx(math.hypot(cmp1["se"], se_counting) / 2)
    assert gains(start, end, level=3)["mean"] is None  # no family measured there
    assert report["largest_drop"] is not None and mismatches(dict(report), GainReport) == []


def test_the_grpo_summary_reads_each_familys_level_and_size_from_the_held_out_set() -> None:
    families = default_config()["grpo"]["curriculum"]["families"]
    eval_set = [p for f in families for p in problems([f], [1], "test", 10, seed=1)]
    start = dict.fromkeys(families, 0.5)
    end = dict.fromkeys(families, 0.7)
    report = held_out_gain(eval_set, start, end, level=1)
    assert set(report["by_family"]) == set(families)
    assert all(set(levels) == {"1"} for levels in report["by_family"].values())
    assert all(
        e["problems"] == 10 for levels in report["by_family"].values() for e in levels.values()
    )
    distinct = {f: len({p.key for p in eval_set if p.family == f}) for f in families}
    assert {f: levels["1"]["distinct"] for f, levels in report["by_family"].items()} == distinct
    assert report["mean"]["gain"] == pytest.approx(0.2)
    assert held_out_gain(eval_set, None, end, level=1) is None


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, tiny, untrained model folder with a BPE trained on task problems."""
    folder = tmp_path_factory.mktemp("model") / "model"
    texts = [
        training_text(p) for p in problems(["comparison", "counting"], [1, 2], "train", 300, seed=3)
    ]
    tokenizer = train_bpe(texts, 300)
    save(tokenizer, folder)
    shape = {
        **default_config()["model"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 1,
    }
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        build_config(model_settings(shape), len(tokenizer))
    ).save_pretrained(folder)
    return folder


def test_evaluate_writes_the_gain_against_a_baseline_as_json(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gain.json"
    evaluate.main([str(model_folder), "--baseline", str(model_folder), "--families", "comparison",
                   "counting", "--levels", "1", "--problems", "6", "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["problems"] == 6 and doc["baseline"] == str(model_folder)
    acc = doc["accuracy"]["comparison"]["1"]
    assert acc["problems"] == 6 and 1 <= acc["distinct"] <= 6
    assert acc["se"] == pytest.approx(standard_error(acc["accuracy"], 6))
    entry = doc["gain"]["by_family"]["comparison"]["1"]
    assert entry["gain"] == 0.0 and entry["se"] == pytest.approx(math.sqrt(2) * acc["se"])
    assert doc["gain"]["mean"]["families"] == ["comparison", "counting"]
    assert doc["model"] == str(model_folder) and doc["seed"] == 1234
    assert doc["baseline_accuracy"] == doc["accuracy"]  # the same folder twice
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[0].split() == [
        "family",
        "level",
        "problems",
        "baseline",
        "model",
        "gain",
        "se",
    ]
    e = doc["gain"]["by_family"]["counting"]["1"]
    assert out_lines[2].split() == ["counting", "1", "6", f"{e['start']:.3f}", f"{e['end']:.3f}",
                                    f"{e['gain']:+.3f}", f"{e['se']:.3f}"]  # fmt: skip
    assert any(
        line.startswith("mean gain at level 1 over comparison, counting: +0.000 (se ")
        for line in out_lines
    )


def test_evaluate_without_a_baseline_ends_each_line_with_the_accuracy(
    model_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evaluate.main(
        [str(model_folder), "--families", "comparison", "--levels", "1", "2", "--problems", "4"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].split() == ["family", "level", "problems", "se", "accuracy"]
    assert lines[1].split()[:3] == ["comparison", "1", "4"] and lines[2].split()[:2] == [
        "comparison",
        "2",
    ]
    assert 0.0 <= float(lines[1].split()[-1]) <= 1.0


def test_evaluate_takes_its_sizes_from_the_configs_evaluate_section_and_shows_progress(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--config gives evaluate.problems and evaluate.levels as the defaults (flags still win),
    and a line on stderr follows each family and level as it is measured, with its accuracy
    and the seconds since the start."""
    config = tmp_path / "config.yaml"
    config.write_text("evaluate: {problems: 5, levels: [2]}\n")
    out = tmp_path / "eval.json"
    began = time.monotonic()
    evaluate.main(
        [str(model_folder), "--config", str(config), "--families", "counting", "--json", str(out)]
    )
    took = time.monotonic() - began
    doc = json.loads(out.read_text())
    assert doc["problems"] == 5 and list(doc["accuracy"]["counting"]) == ["2"]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{model_folder}: loading"
    line = re.fullmatch(
        rf"{re.escape(str(model_folder))}: counting level 2: (\S+) on 5 problems \(1/1, (\d+) s\)",
        err[-1],
    )
    assert line, err[-1]
    assert float(line.group(1)) == pytest.approx(
        doc["accuracy"]["counting"]["2"]["accuracy"], abs=5e-4
    )
    assert 0 <= int(line.group(2)) <= took + 1
    evaluate.main([str(model_folder), "--config", str(config), "--families", "counting", "--problems", "1",
                   "--levels", "1", "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["problems"] == 1 and list(doc["accuracy"]["counting"]) == ["1"]


def test_the_sizes_are_the_flags_else_the_configs_else_one_se_of_0_03() -> None:
    section = EvaluateSettings.from_config(
        stconfig.validate_section("evaluate", {"problems": 7, "levels": [3]})
    )
    assert evaluate.sizes(None, None, None) == ([1, 2], problems_for())
    assert evaluate.sizes(None, None, section) == ([3], 7)
    assert evaluate.sizes([2], 4, section) == ([2], 4)
    assert evaluate.sizes([2], 0, None) == ([2], 0)  # refused by main, not replaced


def test_evaluate_refuses_a_size_of_zero(model_folder: Path) -> None:
    with pytest.raises(SystemExit, match="--problems: expected a positive number"):
        evaluate.main([str(model_folder), "--problems", "0"])


def test_evaluate_refuses_a_path_that_is_not_a_model_folder(
    model_folder: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "model/grpo"  # e.g. before the run that writes it
    with pytest.raises(SystemExit, match=f"model: {missing} is not a model folder"):
        evaluate.main([str(missing)])
    with pytest.raises(SystemExit, match=f"--baseline: {tmp_path} is not a model folder"):
        evaluate.main([str(model_folder), "--baseline", str(tmp_path)])


@pytest.mark.parametrize("manifest", [True, False], ids=["consolidated", "plain-folder"])
def test_evaluate_on_a_cut_shard_is_one_line_naming_it(
    model_folder: Path, tmp_path: Path, manifest: bool
) -> None:
    """A shard cut short (a copy that stopped, a full disk) was a traceback from inside
    safetensors; a consolidated folder names the file against its manifest."""
    folder = tmp_path / "cut"
    shutil.copytree(model_folder, folder)
    (shard,) = folder.glob("*.safetensors")
    size = shard.stat().st_size
    if manifest:
        files = {p.name: {"sha256": "-", "bytes": p.stat().st_size} for p in folder.iterdir()}
        (folder / "MANIFEST.json").write_text(json.dumps({"files": files}))
    with shard.open("r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(SystemExit) as err:
        evaluate.main([str(folder), "--families", "comparison", "--levels", "1", "--problems", "2"])
    message = str(err.value)
    assert "\n" not in message
    if manifest:
        assert message == (f"error: {shard}: {size // 2:,} bytes, but MANIFEST.json lists {size:,}: "
                           "cut short or changed since consolidation")  # fmt: skip
    else:
        assert message.startswith(f"error: {folder}: cannot load the model (")


def test_the_mean_is_over_the_trained_families_and_the_largest_drop_is_named() -> None:
    start = {"comparison": {1: (0.3, 280, 200)}, "counting": {1: (0.9, 280, 280)}}
    end = {"comparison": {1: (0.6, 280, 200)}, "counting": {1: (0.7, 280, 280)}}
    report = gains(start, end, level=1, families=["comparison"])
    assert report["mean"]["families"] == ["comparison"]
    assert report["mean"]["gain"] == pytest.approx(0.3)
    drop = report["largest_drop"]
    assert drop["family"] == "counting" and drop["level"] == 1
    assert drop["sigmas"] == pytest.approx(0.2 / report["by_family"]["counting"]["1"]["se"])
    assert gains(start, start, level=1)["largest_drop"] is None


def test_the_largest_drop_is_the_one_of_most_standard_errors_among_several() -> None:
    """Several entries fall, at two levels: the one named is the fall least likely to be
    noise (most standard errors), not the largest fall in accuracy (measured on a few
    problems) nor the last or first listed; a family that gained is never named."""
    start = {"arithmetic": {1: (0.50, 20, 20), 2: (0.40, 2000, 2000)},
             "comparison": {1: (0.60, 2000, 2000)}, "counting": {1: (0.30, 280, 280)}}  # fmt: skip
    end = {"arithmetic": {1: (0.20, 20, 20), 2: (0.35, 2000, 2000)},
           "comparison": {1: (0.52, 2000, 2000)}, "counting": {1: (0.90, 280, 280)}}  # fmt: skip
    report = gains(start, end, level=1)
    sigmas = {(f, int(lv)): -e["gain"] / e["se"] for f, levels in report["by_family"].items()
              for lv, e in levels.items() if e["gain"] < 0}  # fmt: skip
    assert len(sigmas) == 3
    drop = report["largest_drop"]
    assert drop is not None and (drop["family"], drop["level"]) == ("comparison", 1)
    assert drop["sigmas"] == pytest.approx(max(sigmas.values()))
    assert sigmas[("arithmetic", 1)] < drop["sigmas"]  # the largest fall, on 20 problems


def test_grpo_evaluates_the_curriculum_then_every_other_built_in_corpus_family() -> None:
    from stagetrain.grpo.train import evaluated_families

    meta = {"sources": [{"record": {"kind": "files"}},
                        {"record": {"kind": "generated", "families": ["counting", "comparison"], "max_level": 2}}]}  # fmt: skip
    assert evaluated_families(["comparison"], meta) == ["comparison", "counting"]
    assert evaluated_families(["arithmetic"], {"sources": []}) == ["arithmetic"]


def corpus_prompts(data: dict[str, str]) -> set[str]:
    """Every problem prompt (markers and question) in the corpus shards the tokenizer stage
    wrote, train.bin and val.bin, decoded back to text."""
    from tokenizers import Tokenizer

    from stagetrain.tasks.problem import ANSWER_TOKEN, PROBLEM_TOKEN

    tokenizer = Tokenizer.from_file(str(Path(data["tokenizer"]) / "tokenizer.json"))
    dtype = json.loads(Path(data["meta"]).read_text())["dtype"]
    found: set[str] = set()
    for shard in ("train", "val"):
        ids = np.memmap(data[shard], dtype=dtype, mode="r")
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        found.update(re.findall(rf"{re.escape(PROBLEM_TOKEN)}.*?{re.escape(ANSWER_TOKEN)}", text))
    return found


@pytest.mark.slow
def test_every_evaluation_scores_test_split_problems_the_corpus_and_grpo_never_train_on(
    data: dict[str, str], model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Provenance of what is scored. The `evaluate` target's problems (captured where
    accuracy() hands them to the scorer) and the GRPO stage's held-out set (held_out_set, the
    function the stage calls) are each in the test split, and none is a prompt the tokenizer
    stage put in the corpus shards or one GRPO's prompt draws give it to train on: an
    evaluation drawn from training data would measure memory, not the gain."""
    from stagetrain.config.settings import CurriculumSettings
    from stagetrain.grpo.curriculum import Curriculum
    from stagetrain.grpo.steps import step_prompts
    from stagetrain.grpo.train import held_out_set
    from stagetrain.tasks import prompt, split_of

    config = default_config()
    families, levels = ["arithmetic", "comparison", "counting"], [1, 2]
    scored: list[Any] = []

    def score(model: Any, judge: Any, batch: list[Any], **_: Any) -> list[float]:
        scored.extend(batch)
        return [0.0] * len(batch)

    monkeypatch.setattr(evaluate, "greedy_scores", score)
    evaluate.accuracy(str(model_folder), families, levels, 60, seed=1234)
    seed = config["run"]["seed"]
    section = {**config["grpo"]["curriculum"], "families": families}
    curriculum = CurriculumSettings.from_config(section, "grpo.curriculum")
    grpo_set = held_out_set(families, curriculum, 60, seed=seed)
    assert {p.level for p in scored} == {1, 2} and len(grpo_set) == 3 * 60
    corpus = corpus_prompts(data)
    assert len(corpus) > 1000  # the shards were read: thousands of problems
    trained = set()
    for level in levels:  # GRPO's draws with every family at each level
        at = replace(curriculum, start_level=level)
        start = Curriculum.start(at, families)
        for step in range(1, 201):
            trained.update(p.key for p in step_prompts(start, at, prompts=8, seed=seed, step=step))
    for p in scored + grpo_set:
        assert split_of(p.key) == "test", p
        assert prompt(p) not in corpus, p
        assert p.key not in trained, p


def test_the_lm_eval_tasks_score_with_the_familys_weighted_rewards_and_its_own_success_at(
    model_folder: Path, tmp_path: Path
) -> None:
    """The written tasks' process_results (lmeval.Scorer, what lm-eval calls) on a family whose
    rewards are weighted terms and whose bar is 2.5, not the built-ins' 0/1 at 1.0: a right
    and short answer (2.0 + 0.5) solves, a right but long one (2.0) does not, a short wrong
    one (0.5) does not; the same answers under a bar of 2.0 solve when right."""
    from stagetrain.evaluate.lmeval import Run, Scorer

    rows = [{"q": f"What is {i} doubled?", "a": str(2 * i), "level": 1, "i": i} for i in range(400)]
    (tmp_path / "doubles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def right(completions, i, **kwargs):\n"
        "    return [1.0 if c.strip() == str(2 * n) else 0.0 for c, n in zip(completions, i)]\n"
        "def short(completions, **kwargs):\n"
        "    return [1.0 if len(c.strip()) <= 2 else 0.0 for c in completions]\n"
    )
    rewards = [{"function": f"{tmp_path / 'rewards.py'}:right", "weight": 2.0},
               {"function": f"{tmp_path / 'rewards.py'}:short", "weight": 0.5}]  # fmt: skip

    def scorer(success_at: float) -> tuple[Scorer, list[Any]]:
        family = {"name": "doubles", "files": [str(tmp_path / "doubles.jsonl")], "rewards": rewards,
                  "columns": {"prompt": "q", "answer": "a"}, "success_at": success_at}  # fmt: skip
        run = Run(model=str(model_folder), tasks=stconfig.validate_section("tasks", {"families": [family]}),
                  families=["doubles"], levels=[1], problems=30, seed=3, max_prompt_len=64,
                  max_new_tokens=16, pins={})  # fmt: skip
        path = tmp_path / f"run-{success_at}.json"
        path.write_text(json.dumps(dataclasses.asdict(run)))
        return Scorer(path), run.problems_of("doubles", 1)

    score, held = scorer(2.5)
    short = [k for k, p in enumerate(held) if p.columns["i"] < 5]  # answers of one character
    long = [k for k, p in enumerate(held) if p.columns["i"] >= 50]  # answers of three or more
    assert short and long, [p.columns["i"] for p in held]

    def doc(k: int) -> dict[str, Any]:
        return {"family": "doubles", "level": 1, "index": k}

    def answer(k: int) -> str:
        return str(2 * held[k].columns["i"])

    assert [score(doc(k), answer(k)) for k in short] == [1.0] * len(short)
    assert [score(doc(k), answer(k)) for k in long] == [0.0] * len(long)
    assert [score(doc(k), "x") for k in short + long] == [0.0] * (len(short) + len(long))
    lower, _ = scorer(2.0)
    assert [lower(doc(k), answer(k)) for k in long] == [1.0] * len(long)
