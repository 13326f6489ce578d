"""The command line as users type it: config files on their own, bad config files, the README's commands."""

from __future__ import annotations

import base64
import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from harness.chromium import shown_report_tables
from harness.configs import edit_config, small_grpo, small_run
from harness.datafiles import lm_eval_task
from harness.workflow import REPO, SNAKEMAKE, snakemake
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

pytestmark = pytest.mark.slow
# The README and the docs it sends a reader to for commands (docs/benchmarks.md and
# docs/lab-log.md record how figures were measured, in scratch copies: not run here).
READMES = (
    "README.md",
    "config/README.md",
    "docs/stages.md",
    "docs/grpo.md",
    "docs/checkpoints.md",
    "docs/cluster.md",
    "docs/config.md",
    "docs/errors.md",
    "docs/development.md",
)
# Options after which Snakemake runs no job.
RUNS_NO_JOB = {"-n", "--dry-run", "--unlock", "--report", "--dag", "--lint"}
# A command with a workflow profile submits to a cluster: a dry run here. Every other runs as written.
SUBMITS = "--workflow-profile"


def tiny_model_folder(folder: Path) -> Path:
    """A pretrained-model folder as save_pretrained writes it: a tiny Llama and its own tokenizer.

    The tokenizer is a plain byte-level BPE without the pipeline's special tokens
    (eos, pad, task markers), as a model from elsewhere would be, so preparing it
    adds them and the training stages grow the embeddings.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(["the count of 1 2 3 is 3; 7 is more than 5"] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def continue_config(workdir: Path, model: Path, name: str = "continued") -> str:
    """The continue-from-folder preset pointed at `model`, written into the workdir; its path there."""
    preset = yaml.safe_load((REPO / "config/presets/continue-from-folder.yaml").read_text())
    preset["run"]["name"] = name
    preset["model"]["init_from"] = preset["tokenizer"]["path"] = str(model)
    preset["tokenizer"]["vocab_size"] = 512  # the tiny tokenizer's 300 tokens and the added ones
    # Its 300 tokens make counting level 4's prompts 69 tokens, more than max_prompt_len's 64.
    preset["grpo"]["curriculum"] = {"max_level": 3}
    (workdir / "continue.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    return "continue.yaml"


def test_a_config_file_stands_on_its_own(workdir: Path, tmp_path: Path) -> None:
    """No config/config.yaml underneath a --configfile: init_from is usable, left-out keys take the schema's defaults."""
    file = continue_config(workdir, tiny_model_folder(tmp_path / "model"))
    del_steps = yaml.safe_load((workdir / file).read_text())
    del del_steps["pretrain"]["steps"]  # config.yaml says 300, the schema 200
    (workdir / file).write_text(yaml.safe_dump(del_steps))
    snakemake(workdir, "results/continued/deepspeed/pretrain.json", "--configfile", file)
    ds = json.loads((workdir / "results/continued/deepspeed/pretrain.json").read_text())
    assert ds["scheduler"]["params"]["total_num_steps"] == 200
    plan = json.loads((workdir / "results/continued/plan/pretrain.json").read_text())
    assert plan["model"]["hidden_size"] == 64  # the folder's shape, not config.yaml's 128
    assert not (workdir / "results/tiny").exists()


def test_the_continue_preset_runs_end_to_end(workdir: Path, tmp_path: Path) -> None:
    """config/presets/continue-from-folder.yaml on a tiny saved model, shrunk, through every stage."""
    model = tiny_model_folder(tmp_path / "model")
    file = continue_config(workdir, model)
    small_run(workdir, steps=4, file=file)
    small_grpo(workdir, file=file)
    edit_config(workdir, "hardware", file=file, cpu_ranks=2)
    start = time.monotonic()
    snakemake(workdir, "--configfile", file, "--", "all")
    print(f"continue-from-folder pipeline: {time.monotonic() - start:.0f} s")
    run = workdir / "results/continued"
    size = len(PreTrainedTokenizerFast.from_pretrained(model)) + 4  # eos, pad, the task markers
    assert json.loads((run / "data/meta.json").read_text())["tokenizer_size"] == size
    for stage, step in (("pretrain", 4), ("grpo", 2)):
        manifest = json.loads((run / f"model/{stage}/MANIFEST.json").read_text())
        assert (manifest["stage"], manifest["step"]) == (stage, step)
        config = json.loads((run / f"model/{stage}/config.json").read_text())
        assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
        assert config["vocab_size"] == -(-size // 64) * 64  # grown, padded to vocab_multiple


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("run: [unclosed\n", [], "error: --configfile bad.yaml:2: invalid YAML (expected ',' or ']', but got '<stream end>')"),
        ("", [], "error: --configfile bad.yaml: empty config file; expected a mapping of config sections"),
        ("- run\n- model\n", [], "error: --configfile bad.yaml: expected a mapping of config sections, got list"),
        ("run: {name: a}\nrun: {name: b}\n", [], "error: --configfile bad.yaml:2: duplicate key 'run' (first at line 1); YAML would silently keep only one"),
        (None, [], "error: --configfile bad.yaml: file not found"),
        ("folder", [], "error: --configfile bad.yaml: is a folder, not a file"),
        ("run: [unclosed\n", ["--workflow-profile", "profiles/slurm"], "error: --configfile bad.yaml:2: invalid YAML"),
    ],
    ids=["syntax", "empty", "list", "duplicate", "missing", "folder", "slurm-profile"],
)  # fmt: skip
def test_a_bad_config_file_is_one_line_naming_it(
    workdir: Path, content: str | None, args: list[str], message: str
) -> None:
    """Snakemake reads --configfile before the Snakefile; the profiles' check names the file and line."""
    bad = workdir / "bad.yaml"
    if content == "folder":
        bad.mkdir()
    elif content is not None:
        bad.write_text(content)
    proc = snakemake(workdir, "-n", *args, "--configfile", "bad.yaml", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and not (workdir / "results").exists()


def test_a_dotted_config_entry_is_one_line_saying_what_works(workdir: Path) -> None:
    """`--config pretrain.steps=5` ended in Snakemake's ValueError traceback."""
    proc = snakemake(workdir, "-n", "--config", "pretrain.steps=5", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --config pretrain.steps=5: --config takes top-level keys only (KEY=VALUE, no dots); put the key "
        "in a file instead, `pretrain: {steps: 5}`, and pass --configfile config/config.yaml that-file.yaml"
    )


def test_a_target_after_configfile_is_explained(workdir: Path) -> None:
    """--configfile takes every word after it: `--configfile my.yaml plan` reads `plan` as a file."""
    proc = snakemake(workdir, "-n", "--configfile", "config/config.yaml", "plan", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --configfile plan: file not found (a target written after --configfile is read "
        "as one more config file: put targets before --configfile, or write -- before them)"
    )


def readme_commands() -> list[str]:
    """Every shell line of the READMEs that runs Snakemake (or prepares for it): code blocks and inline code.

    Templates, with a <placeholder> or an elided `...`, are left out.
    """
    commands = []
    for name in READMES:
        text = (REPO / name).read_text()
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
        lines = [line for block in blocks for line in block.splitlines()]
        lines += re.findall(
            r"`(snakemake [^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        )
        for line in lines:
            line = re.sub(r"\s+#.*", "", line).strip()
            if line.startswith(("snakemake ", "cp ")) and not re.search(r"<[^>]+>|\.\.\.", line):
                commands.append(line)
    return list(dict.fromkeys(commands))


def _as_run_here(command: str) -> str:
    """The command with our Snakemake, made a dry run if it submits to a cluster, its pipe kept
    if the tool exists."""
    if not command.startswith("snakemake "):
        return command
    words = command.split("|")[0].split()
    if SUBMITS in words and not RUNS_NO_JOB & set(words):
        words.insert(1, "-n")
    words[0] = SNAKEMAKE
    pipe = command.split("|", 1)[1] if "|" in command else ""
    if pipe and shutil.which(pipe.split()[0]):
        return f"set -o pipefail; {shlex.join(words)} | {pipe}"
    return shlex.join(words)  # graphviz's dot is not everywhere: the Snakemake half still runs


PART_READERS = {"vocab.json": "prepare_tokenizer", "pretrain.json": "pretrain", "grpo.json": "grpo"}


def _only_changed_parts_rerun(workdir: Path, before: dict[str, bytes], log: str) -> None:
    """After a forced detection: the planner ran again, and a stage whose plan part came out
    byte-identical did not (the measured speed moves the estimates, which parts leave out)."""
    ran = set(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", log, flags=re.M))
    assert {"detect_hardware", "plan_parallelism"} <= ran, ran
    for part, stage in PART_READERS.items():
        if (workdir / "results/tiny/plan" / part).read_bytes() == before[part]:
            assert stage not in ran, f"{stage} reran although plan/{part} did not change"


def _evaluated(workdir: Path) -> None:
    """What the `evaluate` target wrote for each model: every family the config names (the
    tasks section's own file family included) and the user's own lm-eval task, as JSON and as
    the report's table; and a second `evaluate` has nothing to do."""
    out = workdir / "results/tiny/evaluate"
    for stage in ("pretrain", "grpo"):
        doc = json.loads((out / f"{stage}.json").read_text())
        assert set(doc["accuracy"]) == {"counting", "comparison", "largest"}
        assert all(e["1"]["problems"] >= 1 for e in doc["accuracy"].values())
        assert 0.0 <= doc["tasks"]["my_yes_no"]["acc,none"] <= 1.0
        rows = (out / f"{stage}.tsv").read_text().splitlines()
        assert rows[0].split("\t") == ["task", "level", "problems", "metric", "value", "se"]
        assert {r.split("\t")[0] for r in rows[1:]} == {
            "counting",
            "comparison",
            "largest",
            "my_yes_no",
        }
    assert "Nothing to be done" in snakemake(workdir, "-n", "evaluate").stdout


def test_every_readme_command_works_as_written(finished_copy: Path, tmp_path: Path) -> None:
    """Every command runs for real, in order, on a copy of the finished small run (so the
    recovery and inspection commands need no --cores), except the cluster submissions, which
    are dry runs. The presets a command trains are shrunk as the default config is. The
    `evaluate` command's outputs are checked here, where it runs, with a task of the user's
    own listed (test_evaluate.py: the harness's scoring, the target's DAG and its refusals)."""
    commands = readme_commands()
    for needed in (
        "snakemake --unlock",
        "snakemake --report report.html",
        "snakemake --dag dot all",
        "snakemake --cores all evaluate",
    ):
        assert any(c.startswith(needed) for c in commands), needed
    task = lm_eval_task(tmp_path / "mine")
    edit_config(finished_copy, "evaluate", problems=8, levels=[1], tasks=[str(task)])
    for command in commands:
        if (
            SUBMITS not in command
            and not RUNS_NO_JOB & set(command.split())
            and " plan" not in command
        ):
            for preset in re.findall(r"--configfile (\S+)", command):
                small_run(finished_copy, steps=4, file=preset)
                small_grpo(finished_copy, file=preset)
        parts = {
            p.name: p.read_bytes() for p in (finished_copy / "results/tiny/plan").glob("*.json")
        }
        began = time.monotonic()
        proc = subprocess.run(["bash", "-c", _as_run_here(command)], cwd=finished_copy,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        print(f"{time.monotonic() - began:5.1f} s  {command}")
        if "--forcerun detect_hardware" in command:
            _only_changed_parts_rerun(finished_copy, parts, proc.stdout + proc.stderr)
        if command.endswith(" evaluate"):
            _evaluated(finished_copy)
    assert (finished_copy / "report.html").stat().st_size > 10_000
    report = (finished_copy / "report.html").read_text()
    for plot, mime in (("pretrain/loss.png", "image/png"), ("grpo/reward.png", "image/png"),
                       ("grpo/completions.html", "text/html")):  # fmt: skip
        name = plot.split("/")[1]
        embedded = re.search(
            rf'"data:{mime};[^",]*filename={name};base64,([A-Za-z0-9+/=]+)"', report
        )
        assert embedded, f"{plot} is not in the report"
        assert (
            base64.b64decode(embedded.group(1))
            == (finished_copy / "results/tiny" / plot).read_bytes()
        )
    assert "<td>" in (finished_copy / "results/tiny/grpo/completions.html").read_text()


def test_a_report_after_a_run_that_stopped_before_grpo_shows_what_exists(
    finished_copy: Path,
) -> None:
    """Snakemake refused it ("... reward.png marked for report but does not exist")."""
    (finished_copy / "results/tiny/grpo/reward.png").unlink()
    proc = subprocess.run([SNAKEMAKE, "--report", "report.html"], cwd=finished_copy,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (finished_copy / "report.html").read_text()
    assert "filename=loss.png;base64," in report and "filename=reward.png" not in report


def test_a_report_after_evaluate_shows_the_evaluation_tables(finished_copy: Path) -> None:
    """`snakemake --report report.html evaluate` after the `evaluate` target: each stage's table is
    in the report, as the rule marks it (a pattern that `reported` once tested as a file name,
    which never existed, so the tables never were), and a person who opens it in Chromium and
    clicks Evaluation, the stage and the table's eye button reads the TSV's rows, cell for cell
    (the TSV alone is only a download link there: Snakemake draws images, HTML and PDF)."""
    edit_config(finished_copy, "evaluate", problems=8, levels=[1])
    snakemake(finished_copy, "evaluate")
    proc = subprocess.run([SNAKEMAKE, "--report", "report.html", "evaluate"], cwd=finished_copy,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (finished_copy / "report.html").read_text()
    out = "results/tiny/evaluate"
    for stage in ("pretrain", "grpo"):
        table = (finished_copy / f"{out}/{stage}.tsv").read_bytes()
        embedded = re.search(rf'filename={stage}\.tsv;base64,([A-Za-z0-9+/=]+)"', report)
        assert embedded, f"evaluate/{stage}.tsv is not in the report"
        assert base64.b64decode(embedded.group(1)) == table
    assert "filename=loss.png;base64," in report and "filename=reward.png;base64," in report
    began = time.monotonic()
    pages = {stage: f"{out}/{stage}.html" for stage in ("grpo", "pretrain")}
    shown = shown_report_tables(finished_copy / "report.html", "Evaluation", pages)
    print(f"{time.monotonic() - began:.1f} s in Chromium")
    for stage, page in pages.items():
        tsv = (finished_copy / f"{out}/{stage}.tsv").read_text()
        rows = [row.split("\t") for row in tsv.splitlines()]
        assert len(rows) > 1 and shown[page] == rows, f"{page} as the report draws it"
