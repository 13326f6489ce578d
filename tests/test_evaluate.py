"""The `evaluate` target: lm-evaluation-harness on the consolidated models, offline, with the run's
held-out problems as local tasks scored by its own rewards."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness.configs import edit_config
from harness.training import SCORING_FAMILIES
from harness.workflow import snakemake

from stagetrain.config import validation as stconfig
from stagetrain.errors import StageError
from stagetrain.evaluate.accuracy import accuracy
from stagetrain.evaluate.lmeval import Run, evaluate

pytestmark = pytest.mark.slow
LENGTHS = (64, 16)


def test_the_harness_scores_the_held_out_problems_as_the_pipeline_does(
    scoring_start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same problems, greedy: the harness's accuracy agrees with `python -m stagetrain.evaluate`'s
    within one standard error, from a model that answers counting level 1 often enough that the
    agreement is not zero against zero."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # evaluate() sets both: undone after
        monkeypatch.setenv(name, "1")
    problems, seed = 48, 7
    run = Run(model=scoring_start, tasks=stconfig.validate_section("tasks", {}), families=SCORING_FAMILIES,
              levels=[1], problems=problems, seed=seed, max_prompt_len=LENGTHS[0], max_new_tokens=LENGTHS[1],
              pins={})  # fmt: skip
    doc = evaluate(run, tmp_path / "tasks", [], batch_size=16)
    ours = accuracy(scoring_start, SCORING_FAMILIES, [1], problems, seed, lengths=LENGTHS)
    for family in SCORING_FAMILIES:
        entry = doc["accuracy"][family]["1"]
        assert entry["problems"] == ours[(family, 1)][1] == problems
        assert abs(entry["accuracy"] - ours[(family, 1)][0]) <= entry["se"], (family, entry, ours)
    assert doc["accuracy"]["counting"]["1"]["accuracy"] >= 0.25


def test_the_evaluate_target_lists_the_evaluations_alone_and_refuses_an_unknown_task(
    finished_copy: Path,
) -> None:
    """What the target writes when it succeeds is checked where the README's own `evaluate`
    command runs it, on the same finished run (test_commands.py)."""
    workdir = finished_copy
    dry = snakemake(workdir, "-n", "evaluate").stdout  # after a finished run: the evaluations alone
    blocks = re.split(r"\n(?:local)?rule (?=\w+:\n)", dry)[1:]
    jobs = {(b.split(":", 1)[0], *re.findall(r"wildcards: stage=(\w+)", b)) for b in blocks}
    assert jobs == {("evaluate_model", "pretrain"), ("evaluate_model", "grpo"), ("evaluate",)}

    edit_config(workdir, "evaluate", tasks=["no_such_task"])
    proc = snakemake(workdir, "evaluate", check=False)
    assert proc.returncode != 0
    line = "error: evaluate.tasks: lm-eval knows no task 'no_such_task', and it is no task file"
    assert line in proc.stdout + proc.stderr
    # The first evaluation to fail stops the run: it leaves its line and no evaluation.
    out = workdir / "results/tiny/evaluate"
    logs = {
        stage: workdir / f"results/tiny/logs/evaluate_{stage}.log" for stage in ("pretrain", "grpo")
    }
    failed = [stage for stage, log in logs.items()
              if log.exists() and log.read_text().strip().splitlines()[-1] == line]  # fmt: skip
    assert failed and not any((out / f"{stage}.json").exists() for stage in failed)


def test_a_task_named_from_lm_evals_catalogue_is_found_there(
    scoring_start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-out tasks and task files need no catalogue, so lm-eval's own is indexed only when
    a task is named from it: `arc_easy` is found there (and then cannot run: its data is not on
    this machine), not refused as unknown."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    run = Run(model=scoring_start, tasks=stconfig.validate_section("tasks", {}), families=SCORING_FAMILIES,
              levels=[1], problems=4, seed=7, max_prompt_len=LENGTHS[0], max_new_tokens=LENGTHS[1],
              pins={})  # fmt: skip
    with pytest.raises(StageError, match=r"^evaluate\.tasks: lm-eval could not run them: "):
        evaluate(run, tmp_path / "tasks", ["arc_easy"], batch_size=16)


def test_plain_transformers_with_only_the_folder_answers_as_the_pipelines_evaluation(
    scoring_start: str,
) -> None:
    """A user with nothing but the consolidated folder: `apply_chat_template` gives the prompt
    the pipeline gives, and `generate` with the folder's own generation config (greedy) ends
    where the pipeline's completion ends, with the same answer, on held-out problems of a model
    that gets some right and some wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stagetrain.tasks import heldout
    from stagetrain.tasks.families import load_tasks
    from stagetrain.tasks.judge import Judge
    from stagetrain.training.evaluation import greedy_completions, greedy_scores

    tokenizer = AutoTokenizer.from_pretrained(scoring_start)
    model = AutoModelForCausalLM.from_pretrained(scoring_start).eval()
    judge = Judge(load_tasks(), tokenizer, max_prompt_len=LENGTHS[0])
    batch = heldout("counting", 1, 24, seed=3)
    with torch.no_grad():
        ours = greedy_completions(model, judge, batch, max_new_tokens=LENGTHS[1], chunk_size=8)
        solved = greedy_scores(model, judge, batch, max_new_tokens=LENGTHS[1], chunk_size=8)
        for problem, completion, score in zip(batch, ours, solved, strict=True):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": problem.question}], add_generation_prompt=True,
                return_tensors="pt", return_dict=True,
            )  # fmt: skip
            assert prompt["input_ids"][0].tolist() == judge.prompt_ids(problem)
            out = model.generate(**prompt, do_sample=False, max_new_tokens=LENGTHS[1])
            new = out[0, prompt["input_ids"].shape[1] :].tolist()
            kept = judge.prompter.completion(completion)  # cut at its first stop, if any
            ended = kept.ids + [completion[len(kept.ids)]] if kept.finished else kept.ids
            assert new == ended, problem
            answer = tokenizer.decode(new, skip_special_tokens=True)
            assert answer == kept.text
            assert float(judge.solved(problem, judge.rewards([problem], [new])[0])) == score
    assert 0 < sum(solved) < len(solved), solved
