"""The artifacts between stages are declared as TypedDicts beside their writers; these tests hold
the declarations to the docs and to what Python can see of them. What the stages really write is
checked against the same types where a run has written it (test_default_run.py)."""

import ast
import re
from typing import Any, NotRequired, TypedDict, get_type_hints

import pytest
from harness.contracts import mismatches
from harness.workflow import REPO

from stagetrain.consolidate.manifest import Manifest
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.evaluate.lmeval import StageEvaluation
from stagetrain.grpo.summary import GrpoSummary
from stagetrain.hardware.report import HardwareReport
from stagetrain.planning.plan import PlanRecord
from stagetrain.pretrain.summary import PretrainSummary
from stagetrain.publish.push import PublishReceipt

DOCUMENTED: dict[str, Any] = {
    "hardware.json": HardwareReport,
    "plan.json": PlanRecord,
    "data/meta.json": TokenizerMeta,
    "pretrain/summary.json": PretrainSummary,
    "grpo/summary.json": GrpoSummary,
    "MANIFEST.json": Manifest,
    "evaluate/<stage>.json": StageEvaluation,
    "publish.json": PublishReceipt,
}
"""Each artifact the Contracts section of docs/architecture.md describes, by the name it
gives, and the type its writer declares."""


def _contracts_text(name: str) -> str:
    """The Contracts section's text about `name`: the paragraphs that name it in backticks
    first, or in which it appears in backticks followed by its keys."""
    section = (
        (REPO / "docs" / "architecture.md").read_text().split("## Contracts between stages")[1]
    )
    section = section.split("\n## ")[0]
    return "\n".join(p for p in section.split("\n") if f"`{name}`" in p)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_the_architecture_doc_names_every_key_an_artifact_declares(name: str) -> None:
    text = _contracts_text(name)
    assert text, f"docs/architecture.md: no paragraph names `{name}`"
    missing = [k for k in get_type_hints(DOCUMENTED[name]) if f"`{k}`" not in text]
    assert missing == [], f"docs/architecture.md, `{name}`: keys not described: {missing}"


def _declares_optional_keys(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Name) and node.id in ("NotRequired", "Required")
        for node in ast.walk(tree)
    )


def _postpones_annotations(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(a.name == "annotations" for a in node.names)
        for node in tree.body
    )


def test_no_module_with_optional_keys_postpones_its_annotations() -> None:
    """Under `from __future__ import annotations` Python 3.11 reads `NotRequired` in a TypedDict
    as a plain string and counts the key as required: the declared contract would be wrong."""
    found = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "src").rglob("*.py"))
        if _declares_optional_keys(tree := ast.parse(path.read_text()))
        and _postpones_annotations(tree)
    ]
    assert found == []


class _Inner(TypedDict):
    a: int
    b: NotRequired[str]


class _Outer(TypedDict):
    inner: list[_Inner]
    maybe: NotRequired[_Inner | None]


@pytest.mark.parametrize(
    ("artifact", "found"),
    [
        ({"inner": [{"a": 1}, {"a": 2, "b": "x"}], "maybe": None}, []),
        ({"inner": [], "extra": 1}, [".extra: written, not in _Outer"]),
        ({"maybe": {"a": 1}}, [".inner: in _Outer, not written"]),
        ({"inner": [{"b": "x"}]}, [".inner[0].a: in _Inner, not written"]),
        ({"inner": [], "maybe": {"a": 1, "c": 2}}, [".maybe.c: written, not in _Inner"]),
    ],
)
def test_the_contract_check_finds_a_stray_or_a_missing_key(
    artifact: dict[str, Any], found: list[str]
) -> None:
    assert mismatches(artifact, _Outer) == found


def test_a_documented_key_the_doc_leaves_out_is_found() -> None:
    """The doc check itself can fail: a key no paragraph names."""
    assert re.search(r"`no_such_key`", _contracts_text("hardware.json")) is None
    assert "no_such_key" not in get_type_hints(HardwareReport)


def test_the_records_written_from_a_dataclass_name_its_fields() -> None:
    """hardware.json's catalog entry and devices are `asdict` of a dataclass, typed by a cast:
    the TypedDict must name exactly the dataclass's fields."""
    from stagetrain.hardware.catalog import GpuSpec
    from stagetrain.hardware.report import DeviceRecord, GpuSpecRecord
    from stagetrain.hardware.visible import Device

    assert GpuSpecRecord.__required_keys__ == set(GpuSpec.__dataclass_fields__)
    assert DeviceRecord.__required_keys__ == set(Device.__dataclass_fields__)


def test_each_debug_log_record_is_what_its_registry_describes() -> None:
    """windows.jsonl and prompts.jsonl: the registry that says what each key means, and the
    type of the records written, name the same keys."""
    from stagetrain.grpo.train import PROMPT_RECORD, PromptRecord
    from stagetrain.pretrain.train import WINDOW_RECORD, WindowRecord

    assert set(WINDOW_RECORD) == WindowRecord.__required_keys__
    assert set(PROMPT_RECORD) == PromptRecord.__required_keys__
