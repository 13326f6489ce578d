"""The `tasks` section: the families the corpus and GRPO draw from, loaded from the config.

A family is a built-in generator (`{name: comparison, generator: comparison}`; the three
generators are families under their own names whether listed or not) or the user's
problems in files: local paths or globs, or `{repo, file, revision}` of a hub dataset, as
.jsonl, .jsonl.gz, .jsonl.zst or .parquet. `columns` says which column holds the prompt,
the answer, the level and (optionally) the worked solution the corpus trains on; every
other column is handed to the family's reward functions under its own name. A numeric
difficulty can be bucketed into levels by `level_edges` (level = 1 + the edges <= it).

Problems split train/val/test by a hash of the prompt, like the generated ones, so a
held-out problem never reaches training or the corpus. Loading checks every row and
every level (levels 1..max without a gap, and enough validation and held-out problems
in each) and names the file and row of the first fault, so a bad file stops the first
stage that reads it (the corpus), before anything trains.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import heapq
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetrain.config.settings import (
    DataSettings,
    GrpoSettings,
    HubTaskFile,
    RewardSpec,
    TaskFamilySettings,
    TasksSettings,
)
from stagetrain.corpus.meta import (
    FamilyRecord,
    FileRecord,
    GeneratedRecord,
    HubFileRecord,
    LocalFileRecord,
    TokenizerMeta,
)
from stagetrain.errors import StageError
from stagetrain.hub import HubError, fetch
from stagetrain.tasks import rewards as task_rewards
from stagetrain.tasks.files import read_rows
from stagetrain.tasks.problem import SPLITS, TASK_TOKENS, Problem, Split, split_of
from stagetrain.tasks.registry import FAMILIES, Family, register
from stagetrain.tasks.reward_source import is_file
from stagetrain.tasks.verify import END_MARKERS

log = logging.getLogger("stagetrain")
KEY = "tasks.families"
CONTROL_TOKENS = (*TASK_TOKENS, *END_MARKERS, "<|bos|>", "<|pad|>")
"""Strings a task row must not hold: its text goes into the generated corpus, where these are
control tokens (stagetrain.tokenizer.build.SPECIAL_TOKENS and the task markers), so a prompt with
"<|pad|>" would become a pad token, and one with "<|problem|>" a second, fake problem."""
MAX_ROW_CHARACTERS = 65_536
"""A task is a question and its answer: a row longer than this is a mistake (a 30 MB row ran BPE
training for more than five minutes, a 1 MB one made train.bin 6.7x train_tokens)."""
MIN_HELD_OUT = 10
"""Test-split problems each level of a file family needs: fewer measure nothing (one
standard error of 10 problems is up to 0.16)."""
MIN_VALIDATION = 1
"""Validation-split problems each level needs (the corpus's val.bin draws from them)."""


@dataclass(frozen=True, kw_only=True)
class TaskFamily:
    """One family of the tasks section, loaded (its name is `family.name`)."""

    key: str
    """Its place in the config ('tasks.families.0'; 'tasks' for an unlisted built-in)."""
    rewards: Sequence[RewardSpec] | None
    success_at: float
    family: Family
    record: FamilyRecord | None = None
    """Provenance for data/meta.json and the GRPO summary: files (hub ones with the commit they
    resolved to) and problems per level and split; None for a built-in generator."""


@dataclass(frozen=True, kw_only=True)
class TaskSet:
    """Every family a run can draw from, and how prompts are rendered."""

    families: dict[str, TaskFamily]
    chat_template: bool
    _built: dict[str, tuple[task_rewards.Reward, ...]] = field(default_factory=dict, repr=False)

    def rewards(self, name: str) -> tuple[task_rewards.Reward, ...]:
        """The family's weighted reward terms, user functions imported (once per process)."""
        if name not in self._built:
            family = self.families[name]
            self._built[name] = task_rewards.build(family.rewards, f"{family.key}.rewards")
        return self._built[name]

    def success_at(self, name: str) -> float:
        """The weighted reward at or above which a completion counts as solving its problem."""
        return self.families[name].success_at

    def record(self) -> dict[str, FamilyRecord]:
        """{family: provenance} of the file families."""
        return {name: f.record for name, f in self.families.items() if f.record}

    def register(self) -> None:
        """Make the file families known to this process (`stagetrain.tasks.registry`): what
        `load_tasks` does, and a rank must redo with a set another process loaded."""
        register([f.family for f in self.families.values() if f.family.pool is not None])


def data_part(tasks: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `tasks` that decide the problems (not the rewards or prompt rendering): what
    the corpus stage reads, so that editing a reward reruns GRPO and nothing upstream. The raw
    section in and out: Snakemake compares a rule's params as given, lists and absent keys
    included, so a typed copy would rerun the stage on every run made before it."""
    keep = ("name", "generator", "files", "columns", "level_edges")
    part: dict[str, Any] = {
        "families": [{k: v for k, v in f.items() if k in keep} for f in tasks.get("families", [])]
    }
    if "max_rows" in tasks:
        part["max_rows"] = tasks["max_rows"]
    return part


def reward_digests(tasks: TasksSettings) -> dict[str, str]:
    """{reward file: sha256 of its content}: part of what GRPO computes, so of its checkpoints'
    fingerprint (an edited reward must not resume a run trained on the old one)."""
    paths = {task_rewards.parse_function(r["function"], KEY)[0]
             for f in tasks.families for r in f.rewards or () if "function" in r}  # fmt: skip
    paths = {
        p for p in paths if is_file(p)
    }  # an installed module is the environment's, as torch is
    out = {}
    for path in sorted(paths):
        try:
            out[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError as err:
            raise StageError(
                f"{KEY}: reward file {path}: cannot read ({err.strerror or err})"
            ) from None
    return out


NO_TASKS = TasksSettings(families=(), chat_template=True, success_at=1.0, max_rows=100_000)
"""The tasks section's defaults: the built-in families, rendered with a chat template."""


def load_tasks(
    tasks: TasksSettings = NO_TASKS, *, pins: Mapping[str, str] | None = None
) -> TaskSet:
    """Every family of the `tasks` section (default: none beyond the built-in ones), file
    families read, checked and registered with `stagetrain.tasks.registry`. `pins` maps a hub
    file ('repo/file@revision') to the commit an earlier stage resolved it to, so every stage
    reads the same files."""
    out: dict[str, TaskFamily] = {
        name: TaskFamily(key="tasks", rewards=None, success_at=tasks.success_at, family=family)
        for name, family in FAMILIES.items()
    }
    for index, entry in enumerate(tasks.families):
        key = f"{KEY}.{index}"
        success_at = tasks.success_at if entry.success_at is None else entry.success_at
        if entry.generator:
            out[entry.name] = TaskFamily(key=key, rewards=entry.rewards, success_at=success_at,
                                         family=FAMILIES[entry.generator])  # fmt: skip
            continue
        family, record = _file_family(entry, key, pins or {}, tasks.max_rows)
        out[entry.name] = TaskFamily(key=key, rewards=entry.rewards, success_at=success_at,
                                     family=family, record=record)  # fmt: skip
    loaded = TaskSet(families=out, chat_template=tasks.chat_template)
    loaded.register()
    return loaded


def hub_name(entry: HubTaskFile) -> str:
    """How a hub file entry is named in pins and messages: 'repo/file@revision'."""
    return f"{entry['repo']}/{entry['file']}@{entry.get('revision', 'main')}"


def _resolved(
    entry: TaskFamilySettings, key: str, pins: Mapping[str, str]
) -> list[tuple[str, str, FileRecord]]:
    """(path to read, name for messages, record) of each file of the family, in config order
    (a glob's matches sorted)."""
    out: list[tuple[str, str, FileRecord]] = []
    for i, item in enumerate(entry.files):
        if isinstance(item, str):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise StageError(f"{key}.files.{i}: {item!r} matches no file")
            out.extend((m, m, LocalFileRecord(path=m)) for m in matches)
            continue
        name = hub_name(item)
        revision = pins.get(name, item.get("revision", "main"))
        try:
            path, commit = fetch(item["repo"], item["file"], revision=revision, repo_type="dataset")
        except HubError as err:
            raise StageError(f"{key}.files.{i}: {err}") from None
        out.append(
            (str(path), f"{item['repo']}/{item['file']}", HubFileRecord(hub=name, commit=commit))
        )
    return out


def _file_family(
    entry: TaskFamilySettings, key: str, pins: Mapping[str, str], max_rows: int
) -> tuple[Family, FamilyRecord]:
    """The family of `entry`'s files, every row and level checked, and its provenance: at most
    `max_rows` problems held, the sample of `sample_rank`, in bounded memory however many rows
    the files hold."""
    kept: dict[str, tuple[str, Problem]] = {}  # key -> (where, problem), in file order
    heap: list[tuple[int, str]] = []  # (-sample rank, key) of the kept: the largest rank on top
    rows = 0
    files = _resolved(entry, key, pins)
    for path, shown, _ in files:
        for where, row in read_rows(path, shown):
            problem = _problem(entry, key, where, row)  # every row is checked, kept or not
            rows += 1
            if problem.key in kept:
                raise StageError(
                    f"{where}: {key} ({entry.name}): duplicate prompt, first given at {kept[problem.key][0]}"
                )
            rank = sample_rank(problem.key)
            if len(heap) < max_rows:
                heapq.heappush(heap, (-rank, problem.key))
            elif rank < -heap[0][0]:
                del kept[heapq.heapreplace(heap, (-rank, problem.key))[1]]
            else:
                continue
            kept[problem.key] = (where, problem)
    if not kept:
        raise StageError(f"{key} ({entry.name}): its files hold no problem")
    if rows > max_rows:
        log.info("task family %s: %d rows, %d kept (tasks.max_rows; the same ones on every run, "
                 "chosen by a hash of each prompt)", entry.name, rows, max_rows)  # fmt: skip
    pool: dict[tuple[int, Split], list[Problem]] = {}
    for _, problem in kept.values():
        pool.setdefault((problem.level, split_of(problem.key)), []).append(problem)
    top = max(level for level, _ in pool)
    counts: dict[int, dict[str, int]] = {
        lv: {s: len(pool.get((lv, s), ())) for s in SPLITS} for lv in range(1, top + 1)
    }
    for level, count in counts.items():
        total = sum(count.values())
        shown = f"{total} problems ({', '.join(f'{n} {s}' for s, n in count.items())})"
        if not total:
            raise StageError(f"{key} ({entry.name}): level {level} has no problem, though level {top} has some; "
                             "levels must run from 1 without a gap (level_edges can bucket a difficulty)")  # fmt: skip
        if count["train"] < 1 or count["val"] < MIN_VALIDATION or count["test"] < MIN_HELD_OUT:
            raise StageError(f"{key} ({entry.name}): level {level} has {shown}; each level needs at least 1 train, "
                             f"{MIN_VALIDATION} validation and {MIN_HELD_OUT} held-out (test) problems: add problems "
                             "or merge levels (level_edges)")  # fmt: skip
    log.info(
        "task family %s: %d problems at levels 1-%d from %d files",
        entry.name,
        len(kept),
        top,
        len(files),
    )
    record = FamilyRecord(
        files=[r for _, _, r in files], problems={str(lv): c for lv, c in counts.items()}
    )
    return Family(name=entry.name, max_level=top, pool=pool), record


def sample_rank(key: str) -> int:
    """Where a problem stands in a capped family's sample: the `tasks.max_rows` problems of
    lowest rank are kept. A hash of the key, so the sample is the same whatever the files'
    order, a duplicate of a row left out is left out too (same key, same rank), and it is
    independent of the split, which hashes the key otherwise."""
    return int.from_bytes(
        hashlib.sha256(f"sample:{key}".encode("utf-8", "surrogatepass")).digest()[:8], "big"
    )


def _column(row: Mapping[str, Any], where: str, key: str, role: str, column: str) -> Any:
    if column not in row:
        raise StageError(
            f"{where}: no column {column!r} ({key}.columns.{role}); the row has: {', '.join(map(str, row)) or 'no column'}"
        )
    return row[column]


def _text(value: Any, where: str, column: str, *, numbers: bool = False) -> str:
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):  # JSON's NaN would become the reference answer "nan"
            raise StageError(
                f"{where}: column {column!r} must be a finite number or text, got {value!r}"
            )
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        kind = "a non-empty string" + (" or a number" if numbers else "")
        raise StageError(f"{where}: column {column!r} must be {kind}, got {value!r}"[:300])
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud800": a lone surrogate, no character at all
        raise StageError(
            f"{where}: column {column!r} holds a lone surrogate ({value[err.start]!r} at character {err.start}), not text"
        ) from None
    return value


def _level(value: Any, edges: Sequence[float] | None, where: str, column: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StageError(f"{where}: column {column!r} (the level) must be a number, got {value!r}")
    if not math.isfinite(value):  # NaN compares false with every edge: it would land in level 1
        raise StageError(
            f"{where}: column {column!r} (the level) must be a finite number, got {value!r}"
        )
    if edges:
        return 1 + sum(1 for edge in edges if value >= edge)
    if not isinstance(value, int) or value < 1:
        raise StageError(f"{where}: column {column!r} (the level) must be an integer >= 1, got {value!r} "
                         "(level_edges buckets other difficulties)")  # fmt: skip
    return value


def _problem(entry: TaskFamilySettings, key: str, where: str, row: Mapping[str, Any]) -> Problem:
    """One row of the user's file as a problem, checked; `row` is the file's, any columns."""
    columns = entry.columns
    raw_prompt = _column(row, where, key, "prompt", columns.prompt)
    messages = (
        _messages(raw_prompt, where, columns.prompt) if is_conversational(raw_prompt) else None
    )
    question = messages[-1]["content"] if messages else _text(raw_prompt, where, columns.prompt)
    answer = _text(
        _column(row, where, key, "answer", columns.answer),
        where,
        columns.answer,
        numbers=True,
    )
    level = 1
    if columns.level:
        level = _level(
            _column(row, where, key, "level", columns.level),
            entry.level_edges,
            where,
            columns.level,
        )
    solution = answer
    if columns.solution:
        solution = _text(
            _column(row, where, key, "solution", columns.solution), where, columns.solution
        )
    asked = "".join(m["content"] for m in messages) if messages else question
    size = len(asked) + len(answer) + len(solution)
    if size > MAX_ROW_CHARACTERS:
        raise StageError(
            f"{where}: a row of {size:,} characters; a task row holds at most {MAX_ROW_CHARACTERS:,}"
        )
    for marker in CONTROL_TOKENS:
        if marker in asked or marker in answer or marker in solution:
            raise StageError(
                f"{where}: prompt, answer and solution must not contain the control token {marker!r}"
            )
    mapped = {c for c in dataclasses.astuple(columns) if c}
    # Every column reaches the rewards under its own name, mapped ones too (TRL's
    # accuracy_reward reads `solution` however the answer is mapped), but for "prompt" (TRL
    # passes it as `prompts` alone) and a mapped column named as a keyword (`answer`, `level`).
    extra = {
        c: v
        for c, v in row.items()
        if c != "prompt" and not (c in mapped and c in task_rewards.RESERVED)
    }
    for name in extra:
        if name in task_rewards.RESERVED:
            raise StageError(f"{where}: column {name!r} is not mapped, and reward functions already get an argument "
                             f"of that name; rename the column or map it in {key}.columns")  # fmt: skip
    identity = (
        question if not messages or len(messages) == 1 else json.dumps(messages, sort_keys=True)
    )
    return Problem(family=entry.name, level=level, question=question, answer=answer, solution=solution,
                   key=identity, origin=where, messages=messages, columns=extra)  # fmt: skip


def is_conversational(prompt: Any) -> bool:
    """TRL's test of a prompt (`trl.data_utils.is_conversational`): a list whose first item is
    a mapping with a "role"."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], Mapping)
        and "role" in prompt[0]
    )


def _messages(value: list[Any], where: str, column: str) -> tuple[dict[str, str], ...]:
    """A conversational prompt checked: {role, content} strings, ending with a user message."""
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise StageError(
                f"{where}: column {column!r} message {i} must have string role and content, got {m!r}"[
                    :300
                ]
            )
        out.append(
            {"role": m["role"], "content": _text(m["content"], where, f"{column}.{i}.content")}
        )
    if out[-1]["role"] != "user":
        raise StageError(
            f"{where}: column {column!r}: the last message must be the user's (the question), not {out[-1]['role']!r}"
        )
    return tuple(out)


def held_out_families(grpo: GrpoSettings, data: DataSettings, tasks: TasksSettings) -> list[str]:
    """The families a held-out evaluation of a run scores: every family its config names (the
    curriculum's, the corpus's, the tasks section's), in that order."""
    return list(dict.fromkeys([*grpo.curriculum.families, *data.generated.families,
                               *(f.name for f in tasks.families)]))  # fmt: skip


def _generated_records(meta: TokenizerMeta) -> Iterator[GeneratedRecord]:
    """The generated source's record of data/meta.json (none in a corpus without it)."""
    for source in meta.get("sources", []):
        record = source["record"]
        if record["kind"] == "generated":
            yield record


def hub_pins(meta: TokenizerMeta) -> dict[str, str]:
    """{hub task file: commit} as the corpus stage resolved them (data/meta.json), so GRPO reads
    the same files even if a branch has moved since."""
    return {
        f["hub"]: f["commit"]
        for record in _generated_records(meta)
        for family in record.get("tasks", {}).values() for f in family["files"] if "hub" in f
    }  # fmt: skip
