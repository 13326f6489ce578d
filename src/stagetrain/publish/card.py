"""The published model card (README.md at the repo's root): how to use the models and how they
were made, every figure from the run's own records.

Sections, in order: the YAML front matter (huggingface_hub's `ModelCardData`: library, tags,
`publish.license`, the start model when it is a hub id, the hub datasets); usage (loading the
GRPO model and the `pretrain` subfolder, the pipeline's `<|problem|>...<|answer|>` prompt, and
that `generate` stops where the pipeline's sampler does, as the folders' generation_config.json
says); the model's shape; the corpus, each source with its files by name, its weight and its
training tokens (data/meta.json); the tasks: each curriculum family's rewards and levels, start,
top and reached (the config's tasks and grpo sections, the GRPO summary's curriculum); training:
the hardware, each stage's layout and steps, and the GRPO settings that shape the model
(group size, KL coefficient, loss type, prompts per step, completion tokens generated, from
grpo/metrics.jsonl); the held-out accuracy before and after GRPO; and, when the `evaluate`
target ran, its accuracy per stage, family and level.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stagetrain.config.inputs import looks_local
from stagetrain.config.settings import GrpoSettings, ModelSettings, TasksSettings
from stagetrain.corpus.meta import SourceShare, TokenizerMeta
from stagetrain.planning.plan import PlanRecord
from stagetrain.tasks.problem import ANSWER_TOKEN, CHAT_TEMPLATE, PROBLEM_TOKEN
from stagetrain.tasks.prompts import renders_chat

if TYPE_CHECKING:  # the types alone: publishing imports no training code (nor torch)
    from stagetrain.grpo.summary import GrpoSummary
    from stagetrain.pretrain.summary import PretrainSummary


@dataclass(frozen=True, kw_only=True)
class RunRecords:
    """What the card is made from: the run's settings and records, read by scripts/publish.py."""

    run: str
    repo: str
    license: str | None
    model: ModelSettings
    grpo_settings: GrpoSettings
    tasks: TasksSettings
    prompting: Prompting
    """Whether the prompts were chat turns or the pipeline's markup (`prompting`)."""
    plan: PlanRecord
    meta: TokenizerMeta
    pretrain: PretrainSummary
    grpo: GrpoSummary
    generated_tokens: int | None
    """The completion tokens GRPO generated, summed over grpo/metrics.jsonl; None without it."""
    evaluations: Mapping[str, Mapping[str, Any]]
    """evaluate/<stage>.json by stage, for the stages the `evaluate` target evaluated."""


def card_text(records: RunRecords) -> str:
    """The model card: front matter for the hub, then the sections of the module docstring."""
    from huggingface_hub import ModelCard, ModelCardData

    r = records
    start = r.model.init_from
    datasets = sorted({s["record"]["repo"] for s in r.meta["sources"] if s["record"]["kind"] == "hub"})  # fmt: skip
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=["stagetrain", "grpo"],
                         license=r.license, base_model=start if start and not looks_local(start) else None,
                         datasets=datasets or None)  # fmt: skip
    shape = r.plan["model"]
    lines = [
        f"# {r.repo.split('/')[-1]}",
        "",
        f"Trained with stagetrain (run `{r.run}`): pretraining, then curriculum GRPO on verifiable tasks. "
        "The GRPO model is at the root of this repo; the pretrained one under `pretrain/`.",
        *_usage(r),
        "## Model",
        "",
        f"- Start: {f'`{start}`' if start else 'from scratch'}; {r.model.architecture}, "
        f"{shape['params'] / 1e6:.2f}M parameters ({shape['active_params'] / 1e6:.2f}M active), "
        f"{shape['num_layers']} layers, hidden {shape['hidden_size']}.",
        "",
        "## Data",
        "",
        *(f"- {source_line(s)}" for s in r.meta["sources"]),
        "",
        *_tasks(r),
        *_training(r),
        *_gain(r),
        *_evaluations(r),
    ]
    body = "\n".join(lines) + "\n"
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


Prompting = Literal["chat", "markup", "markup-template"]
"""How the run prompted: chat turns through a chat model's template, or the pipeline's markup,
which the trained tokenizer's own template renders too ("markup-template")."""


def prompting(tasks: TasksSettings, folder: Path) -> Prompting:
    """How the run prompted, decided as `tasks.prompts.Prompter` decides (`renders_chat`), from
    the folder's tokenizer template (its own file, or in tokenizer_config.json)."""
    jinja, config = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    template: str | None
    if jinja.exists():
        template = jinja.read_text()
    else:
        template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if template == CHAT_TEMPLATE:
        return "markup-template"
    return "chat" if renders_chat(template, tasks.chat_template) else "markup"


def _usage(r: RunRecords) -> list[str]:
    """Loading both models and prompting them as the pipeline does."""
    chat = {
        "chat": "The tokenizer has a chat template and the run used it (`tasks.chat_template`): render "
                "the question as the user turn with `apply_chat_template(..., add_generation_prompt=True)`.",
        "markup": f"Prompts are the pipeline's own markup, `{PROBLEM_TOKEN}question{ANSWER_TOKEN}`; "
                  "the completion is the worked answer.",
    }  # fmt: skip
    chat["markup-template"] = (chat["markup"] + " The tokenizer's chat template renders the same markup, so a "
                               "user turn through `apply_chat_template(..., add_generation_prompt=True)` is the same prompt.")  # fmt: skip
    return ["", "## Usage", "", chat[r.prompting], "", "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'repo = "{r.repo}"',
            "tokenizer = AutoTokenizer.from_pretrained(repo)",
            "model = AutoModelForCausalLM.from_pretrained(repo)  # the GRPO model",
            'pretrained = AutoModelForCausalLM.from_pretrained(repo, subfolder="pretrain")',
            f'ids = tokenizer("{PROBLEM_TOKEN}12+34{ANSWER_TOKEN}", add_special_tokens=False, return_tensors="pt")',
            f"out = model.generate(**ids, max_new_tokens={r.grpo_settings.max_new_tokens}, do_sample=False)",
            'print(tokenizer.decode(out[0, ids["input_ids"].shape[1]:]))', "```", "",
            f"`generate` stops at the end token or at `{PROBLEM_TOKEN}` (a new problem begun), "
            "where the pipeline's sampler stops (generation_config.json).", ""]  # fmt: skip


def source_line(source: SourceShare) -> str:
    """One corpus source of data/meta.json as the card lists it: what (files by name, a hub repo
    at its commit), its weight in the mixture and its training tokens."""
    record = source["record"]
    if record["kind"] == "generated":
        what = f"generated task problems ({', '.join(record['families'])})"
    elif record["kind"] == "files":
        what = f"local files {', '.join(f'`{f}`' for f in record['files'])}"
    elif record["kind"] == "hub":
        what = f"`{record['repo']}` at commit `{record['commit']}` ({', '.join(f'`{f}`' for f in record['files'])})"
    else:  # a kind this version does not write
        what = source["name"]
    repeats = source.get("train_repeats", 0)  # absent from a corpus made before it was counted
    again = f" (its documents read {repeats + 1} times to fill its share)" if repeats else ""
    return f"{what}: weight {source['weight']:g}, {source['train_tokens']:,} training tokens{again}"


def _rewards(r: RunRecords, family: str) -> str:
    """A family's rewards as the config gives them (none: its problems' own verifier)."""
    for entry in r.tasks.families:
        if entry.name == family and entry.rewards:
            return ", ".join(
                f"{e.get('function') or 'verifier ' + e.get('verifier', '')} x {e['weight']:g}"
                for e in entry.rewards
            )
    return "its problems' own verifier x 1"


def _tasks(r: RunRecords) -> list[str]:
    """The curriculum's families: rewards, and the levels each started at, could reach, reached."""
    cur = r.grpo_settings.curriculum
    lines = ["## Tasks and curriculum", "",
             f"Each family's level moves with its rolling success rate over {cur.window} prompts: up at "
             f"{cur.promote_at:g} or more, down at {cur.demote_below:g} or less (at least {cur.min_steps} steps "
             f"at a level); levels {cur.start_level} to {cur.max_level}.", "",
             "| family | rewards | level reached |", "| --- | --- | --- |"]  # fmt: skip
    for family in cur.families:
        state = r.grpo["curriculum"].get(family)
        reached = state["level"] if state else "-"
        lines.append(f"| {family} | {_rewards(r, family)} | {reached} |")
    return [*lines, ""]


def _training(r: RunRecords) -> list[str]:
    """The hardware, each stage's layout and steps, and the GRPO settings that shape the model."""
    plan, g = r.plan, r.grpo_settings
    lines = ["## Training", "",
             f"- Hardware: {plan['world']} x {plan['device']} on {plan['nodes']} node(s), {plan['precision']}."]  # fmt: skip
    for stage, summary in (("pretrain", r.pretrain), ("grpo", r.grpo)):
        lay = summary["layout"]
        tokens = (
            summary["final_step"] * lay["global_batch"] * lay["seq_len"]
            if stage == "pretrain"
            else None
        )
        lines.append(
            f"- {stage}: {summary['final_step']} steps, dp={lay['dp']} tp={lay['tp']}"
            f"{' ep=' + str(lay['ep']) if lay.get('ep', 1) > 1 else ''} ZeRO-{lay['zero_stage']} "
            f"micro batch {lay['micro_batch_size']} x {lay['grad_accum']} accumulation"
            + (f", {tokens:,} tokens" if tokens else "")
        )  # fmt: skip
    generated = f"{r.generated_tokens:,}" if r.generated_tokens is not None else "not recorded"
    lines.append(
        f"- GRPO: loss `{g.loss_type}`, group size {g.group_size}, KL coefficient {g.kl_coef:g}, "
        f"{g.prompts_per_step} prompts per step, {r.grpo['final_step']} steps "
        f"({r.grpo['optimizer_steps']} optimizer steps), {g.rollout} rollouts at temperature "
        f"{g.temperature:g} (top-p {g.top_p:g}), at most {g.max_new_tokens} new tokens; "
        f"completion tokens generated: {generated}."
    )
    return lines


def _gain(r: RunRecords) -> list[str]:
    """The held-out accuracy before and after GRPO (none when the metrics lost step 0's)."""
    gain = r.grpo["accuracy"]["gain"]
    if not gain:
        return []
    lines = ["", "## Held-out accuracy", "", "Greedy, on problems no stage trained on, before and after GRPO:", "",
             "| family | level | before | after | gain | se |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for family, levels in gain["by_family"].items():
        for level, e in levels.items():
            lines.append(f"| {family} | {level} | {e['start']:.3f} | {e['end']:.3f} | {e['gain']:+.3f} | {e['se']:.3f} |")  # fmt: skip
    return lines


def _evaluations(r: RunRecords) -> list[str]:
    """The `evaluate` target's accuracy per stage, family and level, when it ran."""
    if not r.evaluations:
        return []
    lines = ["", "## Evaluation (lm-evaluation-harness)", "",
             "The run's held-out problems as lm-eval tasks, greedy:", "",
             "| model | family | level | accuracy | se | problems |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for stage, result in r.evaluations.items():
        for family, levels in result.get("accuracy", {}).items():
            for level, e in levels.items():
                lines.append(f"| {stage} | {family} | {level} | {e['accuracy']:.3f} | {e['se']:.3f} | {e['problems']} |")  # fmt: skip
    return lines
