"""parallelism_data.json tables: local files, and hub downloads with the real client.

Hub tests run the real `huggingface_hub` client against the loopback hub of
`harness/hub.py`. The client reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and its cache
location when it is imported, so every hub call runs in a fresh Python process with
its own environment (`harness.hub.hub_call`), which prints a JSON result for the test.
"""

from __future__ import annotations

import json
import re
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from harness.hub import (
    DEFAULT_TOKEN,
    NO_BACKOFF_SLEEP,
    HubServer,
    closed_port,
    commit_sha,
    hub_call,
    serve_hub,
)

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import ParallelismSettings
from stagetrain.errors import StageError
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.planning import table as tables
from stagetrain.planning.resolve import table_values
from stagetrain.planning.search import Devices

TABLE = {
    "H100": {
        "8": {"dp": 8, "tp": 1, "micro_batch_size": 4},
        "16": {"dp": 8, "tp": 2, "micro_batch_size": 2},
    },
    "A100-80GB": {"8": {"dp": 4, "tp": 2, "micro_batch_size": 1}},
}
TABLE_V1 = {"H100": {"8": {"dp": 4, "tp": 2, "micro_batch_size": 1}}}
SHA_MAIN = commit_sha("main")
SHA_V1 = commit_sha("v1")
SHA_OTHER = commit_sha("other")
HEX40 = re.compile(r"[0-9a-f]{40}")
ENTRY_HINT = "(expected a GPU count mapping to positive integers dp, tp, micro_batch_size)"
UNREACHABLE = (
    "hub unreachable or offline (HF_HUB_OFFLINE) and parallelism_data.json not in the cache"
)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _repos(**extra: bytes) -> dict[str, Any]:
    """The standard test hub, plus one repo per keyword (`org/<name>` serving that content)."""
    repos: dict[str, Any] = {
        "org/tables": {
            "main": (SHA_MAIN, {"parallelism_data.json": _json(TABLE), "README.md": b"# t"}),
            "v1": (SHA_V1, {"parallelism_data.json": _json(TABLE_V1)}),
        },
        "org/no-table": {"main": (SHA_OTHER, {"config.json": b"{}"})},
        "org/private": {"main": (SHA_OTHER, {"parallelism_data.json": _json(TABLE_V1)})},
        "org/gated": {"main": (SHA_OTHER, {"parallelism_data.json": _json(TABLE_V1)})},
        "org/forbidden": {"main": (SHA_OTHER, {"parallelism_data.json": _json(TABLE_V1)})},
    }
    for name, content in extra.items():
        repos[f"org/{name}"] = {"main": (SHA_OTHER, {"parallelism_data.json": content})}
    return repos


def _serve(**extra: bytes) -> AbstractContextManager[HubServer]:
    return serve_hub(
        _repos(**extra),
        private={"org/private"},
        gated={"org/gated"},
        forbidden={"org/forbidden"},
    )


DOWNLOAD = """
import json, sys
from stagetrain.planning import table
try:
    found, source = table.download(sys.argv[1], sys.argv[2])
    print(json.dumps({"table": found, "source": source}))
except table.TableMiss as miss:
    print(json.dumps({"miss": str(miss)}))
"""


def download(
    tmp_path: Path, hub: HubServer | str, repo: str, revision: str = "main", **kw: Any
) -> dict[str, Any]:
    """`table.download(repo, revision)` in a subprocess: {"table", "source"} or {"miss"}."""
    endpoint = hub if isinstance(hub, str) else hub.endpoint
    return hub_call(tmp_path, endpoint, [repo, revision], code=kw.pop("code", DOWNLOAD), **kw)


# --- hub downloads -----------------------------------------------------------


def test_download_returns_the_table_and_the_commit_main_resolved_to(tmp_path: Path) -> None:
    with _serve() as hub:
        result = download(tmp_path, hub, "org/tables")
    assert result == {"table": TABLE, "source": f"hub:org/tables@{SHA_MAIN}"}
    assert HEX40.fullmatch(result["source"].rsplit("@", 1)[1])
    # The real client asked for metadata, then the file; no token was configured or sent.
    calls = [(r.method, r.path, r.authorization) for r in hub.requests]
    assert calls == [
        ("HEAD", "/org/tables/resolve/main/parallelism_data.json", None),
        ("GET", "/org/tables/resolve/main/parallelism_data.json", None),
    ]
    # The cache pins "main" to the commit the server answered with.
    ref = tmp_path / "cache" / "models--org--tables" / "refs" / "main"
    assert ref.read_text() == SHA_MAIN


def test_download_of_a_tag_and_of_a_commit(tmp_path: Path) -> None:
    with _serve() as hub:
        by_tag = download(tmp_path, hub, "org/tables", "v1")
        by_commit = download(tmp_path, hub, "org/tables", SHA_MAIN, cache=tmp_path / "other")
    assert by_tag == {"table": TABLE_V1, "source": f"hub:org/tables@{SHA_V1}"}
    assert by_commit == {"table": TABLE, "source": f"hub:org/tables@{SHA_MAIN}"}


@pytest.mark.parametrize(
    ("repo", "revision", "reason"),
    [
        ("org/missing", "main", "repository not found (or private without a token)"),
        ("org/no-table", "main", "has no parallelism_data.json"),
        ("org/tables", "no-such-branch", "revision not found"),
        ("org/private", "main", "unauthorised (HTTP 401; check HF_TOKEN)"),
        ("org/gated", "main", "unauthorised (gated repo; set HF_TOKEN)"),
        ("org/forbidden", "main", "unauthorised (HTTP 403; check HF_TOKEN)"),
    ],
)
def test_download_misses_name_the_reason(
    tmp_path: Path, repo: str, revision: str, reason: str
) -> None:
    with _serve() as hub:
        result = download(tmp_path, hub, repo, revision)
    assert result == {"miss": f"hub repo {repo!r}@{revision}: {reason}"}
    assert [r.method for r in hub.requests] == ["HEAD"]  # nothing downloaded after the refusal


def test_private_repo_with_a_token_downloads_and_sends_it(tmp_path: Path) -> None:
    with _serve() as hub:
        result = download(tmp_path, hub, "org/private", token=DEFAULT_TOKEN)
    assert result == {"table": TABLE_V1, "source": f"hub:org/private@{SHA_OTHER}"}
    assert [(r.method, r.authorization) for r in hub.requests] == [
        ("HEAD", f"Bearer {DEFAULT_TOKEN}"),
        ("GET", f"Bearer {DEFAULT_TOKEN}"),
    ]


def test_private_repo_with_a_wrong_token_is_unauthorised(tmp_path: Path) -> None:
    with _serve() as hub:
        result = download(tmp_path, hub, "org/private", token="hf_wrong")
    assert result == {
        "miss": "hub repo 'org/private'@main: unauthorised (HTTP 401; check HF_TOKEN)"
    }
    assert [r.authorization for r in hub.requests] == ["Bearer hf_wrong"]


def test_invalid_repo_id_is_a_miss_not_a_crash(tmp_path: Path) -> None:
    # model.init_from naming a local folder that does not exist is taken for a repo id.
    with _serve() as hub:
        result = download(tmp_path, hub, "./checkpoints/run1")
    assert result == {
        "miss": "hub repo './checkpoints/run1'@main: not a valid hub repo id (namespace/name)"
    }
    assert hub.requests == []


def test_unreachable_hub_is_a_miss(tmp_path: Path) -> None:
    result = download(
        tmp_path, f"http://127.0.0.1:{closed_port()}", "org/tables", prelude=NO_BACKOFF_SLEEP
    )
    assert result == {"miss": f"hub repo 'org/tables'@main: {UNREACHABLE}"}


TIMED = """
import json, sys, time
from stagetrain.planning import table
start = time.monotonic()
try:
    result = {"table": table.download(sys.argv[1], sys.argv[2])[0]}
except table.TableMiss as miss:
    result = {"miss": str(miss)}
print(json.dumps({**result, "seconds": time.monotonic() - start}))
"""


def test_a_slow_hub_is_an_unreachable_miss_within_the_time_limit(tmp_path: Path) -> None:
    # The hub answers after 30 s; the client alone would wait 10 s, then 60 s per retry.
    with serve_hub(_repos(), delay_s=30) as hub:
        result = download(tmp_path, hub, "org/tables", code=TIMED, timeout_s=1.5)
    assert result.pop("seconds") < 1.5 + 1.0
    assert result == {
        "miss": "hub repo 'org/tables'@main: hub unreachable (ReadTimeout; gave up within the 1.5 s "
        "limit of STAGETRAIN_HUB_TIMEOUT_S) and parallelism_data.json not in the cache"
    }
    assert [r.method for r in hub.requests] == ["HEAD"]


def test_a_slow_hub_with_a_warm_cache_answers_from_the_cache(tmp_path: Path) -> None:
    with _serve() as hub:
        online = download(tmp_path, hub, "org/tables")
    with serve_hub(_repos(), delay_s=30) as hub:
        result = download(tmp_path, hub, "org/tables", code=TIMED, timeout_s=1.5)
    assert result.pop("seconds") < 1.5 + 1.0
    assert result == {"table": online["table"]}


def test_the_time_limit_must_be_a_positive_number(tmp_path: Path) -> None:
    code = DOWNLOAD.replace("table.TableMiss", "StageError").replace(
        "import json, sys", "import json, sys\nfrom stagetrain.errors import StageError"
    )
    with _serve() as hub:
        for bad in ("soon", "0", "-2", "nan", "inf"):
            result = download(tmp_path, hub, "org/tables", code=code, timeout_s=bad)
            assert result == {
                "miss": f"STAGETRAIN_HUB_TIMEOUT_S: expected a positive number of seconds, got {bad!r}"
            }
    assert hub.requests == []


def test_a_refusing_hub_is_not_answered_by_the_cache(tmp_path: Path) -> None:
    # A cache shared by users with different rights: one with the token fills it...
    with _serve() as hub:
        allowed = download(tmp_path, hub, "org/private", token=DEFAULT_TOKEN)
        assert allowed["source"] == f"hub:org/private@{SHA_OTHER}"
        # ...then one without a token, or with a wrong one, is refused by the hub.
        refused = download(tmp_path, hub, "org/private")
        wrong = download(tmp_path, hub, "org/private", token="hf_wrong")
    reason = "unauthorised (HTTP 401; check HF_TOKEN); the cached copy is not used"
    assert refused == {"miss": f"hub repo 'org/private'@main: {reason}"}
    assert wrong == refused
    # The hub was asked each time; the refusals were not followed by a download.
    assert [(r.method, r.authorization) for r in hub.requests] == [
        ("HEAD", f"Bearer {DEFAULT_TOKEN}"),
        ("GET", f"Bearer {DEFAULT_TOKEN}"),
        ("HEAD", None),
        ("HEAD", "Bearer hf_wrong"),
    ]


def test_a_404_to_the_clients_side_request_is_no_refusal_of_the_file(tmp_path: Path) -> None:
    """With telemetry on, huggingface_hub asks <endpoint>/api/agent-harnesses for its user-agent
    header; a mirror or hub without that API answers 404, which failed every first fetch as a
    refusal ("HTTP error 404; the cached copy is not used")."""
    telemetry = "import os\nos.environ.pop('HF_HUB_DISABLE_TELEMETRY', None)\n"
    with _serve() as hub:
        result = download(tmp_path, hub, "org/tables", prelude=telemetry)
    assert result == {"table": TABLE, "source": f"hub:org/tables@{SHA_MAIN}"}
    assert "/api/agent-harnesses" in [r.path for r in hub.requests]


def test_malformed_json_on_the_hub(tmp_path: Path) -> None:
    bad = '{"H100": {"8": {"dp": 8,}}}'
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(bad)
    with _serve(bad=bad.encode(), binary=b"\xff\xfe\x00{") as hub:
        result = download(tmp_path, hub, "org/bad")
        binary = download(tmp_path, hub, "org/binary")
    assert result == {
        "miss": f"hub repo 'org/bad'@main: malformed JSON ({err.value.msg} at line 1)"
    }
    assert binary == {"miss": "hub repo 'org/binary'@main: malformed JSON (not UTF-8 text)"}


@pytest.mark.parametrize(
    "entry",
    [
        {"dp": 8, "micro_batch_size": 4},  # no tp
        {"dp": 8, "tp": "1", "micro_batch_size": 4},  # a string
        {"dp": 8, "tp": 1.0, "micro_batch_size": 4},  # a float
        {"dp": 8, "tp": True, "micro_batch_size": 4},  # JSON true is not 1
        {"dp": 8, "tp": 0, "micro_batch_size": 4},  # not positive
    ],
    ids=["missing-tp", "string", "float", "bool", "zero"],
)
def test_structurally_malformed_table_on_the_hub_names_the_entry(
    tmp_path: Path, entry: dict[str, Any]
) -> None:
    content = _json({"H100": {"4": {"dp": 4, "tp": 1, "micro_batch_size": 1}, "8": entry}})
    with _serve(shape=content) as hub:
        result = download(tmp_path, hub, "org/shape")
    assert result == {
        "miss": f"hub repo 'org/shape'@main: malformed table at 'H100'.'8' {ENTRY_HINT}"
    }


def test_offline_reads_the_cached_table_with_its_commit(tmp_path: Path) -> None:
    with _serve() as hub:
        online = download(tmp_path, hub, "org/tables")
        endpoint = hub.endpoint
    assert online["source"] == f"hub:org/tables@{SHA_MAIN}"
    # The server is stopped (its port refuses connections): only the cache can answer.
    offline = download(tmp_path, endpoint, "org/tables", offline=True)
    assert offline == online
    assert len(hub.requests) == 2  # HEAD and GET of the first download only


def test_offline_with_an_empty_cache_is_a_miss(tmp_path: Path) -> None:
    with _serve() as hub:
        result = download(tmp_path, hub, "org/tables", offline=True)
    assert result == {"miss": f"hub repo 'org/tables'@main: {UNREACHABLE}"}
    assert hub.requests == []


def test_the_token_is_never_written(tmp_path: Path) -> None:
    secret = "hf_secret_test_token"
    with serve_hub(_repos(), private={"org/tables"}, token=secret) as hub:
        result = download(tmp_path, hub, "org/tables", token=secret)
    assert result["source"] == f"hub:org/tables@{SHA_MAIN}"  # the token was needed and used
    assert {r.authorization for r in hub.requests} == {f"Bearer {secret}"}
    assert secret not in json.dumps(result)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "parallelism_data.json" for p in written)
    assert [p for p in written if secret.encode() in p.read_bytes()] == []


# --- local files, parse and lookup --------------------------------------------


def test_read_local_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "parallelism_data.json"
    path.write_text(json.dumps(TABLE))
    assert tables.read_local(path) == (TABLE, f"file:{path}")
    assert tables.read_local(str(path)) == (TABLE, f"file:{path}")


def test_read_local_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "parallelism_data.json"
    with pytest.raises(tables.TableMiss) as miss:
        tables.read_local(path)
    assert str(miss.value) == f"parallelism.table_path: {path}: file not found"


def test_read_local_unreadable_paths_are_misses(tmp_path: Path) -> None:
    with pytest.raises(tables.TableMiss) as miss:
        tables.read_local(tmp_path)  # a directory
    assert str(miss.value) == f"parallelism.table_path: {tmp_path}: cannot be read (Is a directory)"
    binary = tmp_path / "table.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(tables.TableMiss) as miss:
        tables.read_local(binary)
    assert str(miss.value) == f"{binary}: malformed JSON (not UTF-8 text)"


def test_read_local_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{\n  "H100": {"8": }\n}')
    with pytest.raises(tables.TableMiss) as miss:
        tables.read_local(path)
    assert str(miss.value) == f"{path}: malformed JSON (Expecting value at line 2)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "here: malformed table (expected an object of GPU keys)"),
        ('{"H100": [8]}', "here: malformed table at 'H100' (expected an object of GPU counts)"),
        (
            '{"H100": {"eight": {"dp": 8, "tp": 1, "micro_batch_size": 1}}}',
            f"here: malformed table at 'H100'.'eight' {ENTRY_HINT}",
        ),
        (
            '{"H100": {"\u00b2": {"dp": 2, "tp": 1, "micro_batch_size": 1}}}',
            f"here: malformed table at 'H100'.'\u00b2' {ENTRY_HINT}",
        ),
        ('{"H100": {"8": 8}}', f"here: malformed table at 'H100'.'8' {ENTRY_HINT}"),
    ],
    ids=["list", "counts-not-object", "count-not-digits", "count-superscript", "entry-not-object"],
)
def test_parse_rejects_malformed_tables(text: str, message: str) -> None:
    with pytest.raises(tables.TableMiss) as miss:
        tables.parse(text, "here")
    assert str(miss.value) == message


def test_parse_keeps_extra_keys_and_lookup_returns_only_the_plan_keys() -> None:
    table = tables.parse(
        '{"H100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 4, "note": "x"}}}', "here"
    )
    assert table["H100"]["8"]["note"] == "x"
    assert tables.lookup(table, "H100", 8, "here") == {"dp": 8, "tp": 1, "micro_batch_size": 4}


def test_lookup_finds_the_entry_for_the_gpu_and_count() -> None:
    assert tables.lookup(TABLE, "H100", 16, "src") == {"dp": 8, "tp": 2, "micro_batch_size": 2}
    assert tables.lookup(TABLE, "A100-80GB", 8, "src") == {"dp": 4, "tp": 2, "micro_batch_size": 1}


@pytest.mark.parametrize(
    ("table", "gpu", "world", "message"),
    [
        (TABLE, "L4", 8, "src: no entry for L4 x 8 (the table has H100: 8, 16; A100-80GB: 8)"),
        (TABLE, "H100", 4, "src: no entry for H100 x 4 (the table has H100: 8, 16; A100-80GB: 8)"),
        ({}, "H100", 8, "src: no entry for H100 x 8 (the table has nothing)"),
    ],
    ids=["no-gpu-key", "no-count", "empty"],
)
def test_lookup_miss_lists_what_the_table_has(
    table: dict[str, Any], gpu: str, world: int, message: str
) -> None:
    with pytest.raises(tables.TableMiss) as miss:
        tables.lookup(table, gpu, world, "src")
    assert str(miss.value) == message


# --- table_values -------------------------------------------------------------


def _devices(gpu: str | None = "H100", per_node: int = 8) -> Devices:
    return Devices(
        gpu=gpu_spec(gpu) if gpu else None,
        nodes=1,
        per_node=per_node,
        device_bytes=80 * 2**30,
        host_bytes_per_node=None,
        inter_node_gbps=50,
    )


def _section(**changes: Any) -> dict[str, Any]:
    """The validated parallelism section with `changes` (JSON: the hub cases pass it to a process)."""
    return stconfig.validate_section("parallelism", changes)


def _parallelism(**changes: Any) -> ParallelismSettings:
    return ParallelismSettings.from_config(_section(**changes), "parallelism")


NO_INIT = None  # model.init_from unset


def test_table_values_uses_a_local_entry(tmp_path: Path) -> None:
    path = tmp_path / "parallelism_data.json"
    path.write_text(json.dumps(TABLE))
    entry, record = table_values(_parallelism(table_path=str(path)), NO_INIT, _devices(per_node=8))
    assert entry == {"dp": 8, "tp": 1, "micro_batch_size": 4}
    assert record == {"status": "used", "source": f"file:{path}", "entry": entry}


def test_table_values_miss_falls_back_to_the_planner_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "parallelism_data.json"
    path.write_text(json.dumps(TABLE))
    entry, record = table_values(_parallelism(table_path=str(path)), NO_INIT, _devices(per_node=4))
    assert entry is None
    assert record == {
        "status": "miss",
        "reason": f"file:{path}: no entry for H100 x 4 (the table has H100: 8, 16; A100-80GB: 8); "
        "falling back to the planner",
    }


def test_table_values_miss_fails_when_asked_to(tmp_path: Path) -> None:
    path = tmp_path / "missing.json"
    with pytest.raises(StageError) as err:
        table_values(_parallelism(table_path=str(path), on_table_miss="error"), NO_INIT, _devices())
    assert str(err.value) == f"parallelism.table_path: {path}: file not found"


def test_table_values_skips_tables_on_cpu(tmp_path: Path) -> None:
    # The path does not exist: skipping must not even read it, whatever on_table_miss says.
    parallelism = _parallelism(table_path=str(tmp_path / "missing.json"), on_table_miss="error")
    assert table_values(parallelism, NO_INIT, _devices(gpu=None)) == (
        None,
        {"status": "skipped", "reason": "tables describe GPUs; planning for CPU ranks"},
    )


def test_table_values_without_a_table(tmp_path: Path) -> None:
    local_model = tmp_path / "model"
    local_model.mkdir()  # an existing local init_from is not a hub repo
    for init_from in (NO_INIT, str(local_model)):
        assert table_values(_parallelism(), init_from, _devices()) == (
            None,
            {"status": "none", "reason": "no table_path or table_repo configured"},
        )


TABLE_VALUES = """
import json, sys
from stagetrain.errors import StageError
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.planning.resolve import table_values
from stagetrain.planning.search import Devices
from stagetrain.config.settings import ParallelismSettings

devices = Devices(gpu=gpu_spec("H100"), nodes=1, per_node=8, device_bytes=80 * 2**30,
                  host_bytes_per_node=None, inter_node_gbps=50)
out = []
for section, init_from in json.loads(sys.argv[1]):
    parallelism = ParallelismSettings.from_config(section, "parallelism")
    try:
        out.append(list(table_values(parallelism, init_from, devices)))
    except StageError as err:
        out.append({"StageError": str(err)})
print(json.dumps(out))
"""


def test_table_values_from_the_hub(tmp_path: Path) -> None:
    cases = [
        (_section(table_repo="org/tables"), NO_INIT),
        (_section(table_repo="org/tables", table_revision="v1"), NO_INIT),
        (_section(), "org/tables"),  # the model's repo, by default
        (_section(table_repo="org/no-table"), "org/tables"),
        (_section(table_repo="org/gated", on_table_miss="error"), NO_INIT),
    ]
    with _serve() as hub:
        results = hub_call(tmp_path, hub.endpoint, [json.dumps(cases)], code=TABLE_VALUES)
    used_main = {"status": "used", "source": f"hub:org/tables@{SHA_MAIN}"}
    assert results == [
        [{"dp": 8, "tp": 1, "micro_batch_size": 4}, {**used_main, "entry": TABLE["H100"]["8"]}],
        [
            {"dp": 4, "tp": 2, "micro_batch_size": 1},
            {
                "status": "used",
                "source": f"hub:org/tables@{SHA_V1}",
                "entry": TABLE_V1["H100"]["8"],
            },
        ],
        [{"dp": 8, "tp": 1, "micro_batch_size": 4}, {**used_main, "entry": TABLE["H100"]["8"]}],
        [
            None,
            {
                "status": "miss",
                "reason": "hub repo 'org/no-table'@main: has no parallelism_data.json; "
                "falling back to the planner",
            },
        ],
        {"StageError": "hub repo 'org/gated'@main: unauthorised (gated repo; set HF_TOKEN)"},
    ]


# --- entries that parse but do not fit the run (plan through resolve) -----------

MISFITS = [
    (
        {"dp": 4, "tp": 4, "micro_batch_size": 1},
        {},
        "dp * tp must equal the world size (dp=4, tp=4, world=8, heads=32, kv_heads=8)",
    ),
    (
        {"dp": 8, "tp": 1, "micro_batch_size": 3},
        {},
        "micro_batch_size must divide the pretrain batch of 32 sequences per rank "
        "(micro_batch_size=3, dp=8)",
    ),
    (
        {"dp": 1, "tp": 16, "micro_batch_size": 1},
        {"hardware": {"nodes": 2}},
        "tp must divide the attention and KV heads (dp=1, tp=16, world=16, heads=32, kv_heads=8)",
    ),
    (
        # The config's own tp stays; with the entry's dp it cannot fill the world.
        {"dp": 8, "tp": 1, "micro_batch_size": 1},
        {"parallelism": {"tp": 2}},
        "dp * tp must equal the world size (dp=8, tp=2, world=8, heads=32, kv_heads=8)",
    ),
]


@pytest.mark.parametrize(
    ("entry", "sections", "why"), MISFITS, ids=["world", "micro-batch", "heads", "with-config"]
)
def test_an_entry_that_does_not_fit_the_run_is_a_miss(
    tmp_path: Path, entry: dict[str, int], sections: dict[str, dict[str, Any]], why: str
) -> None:
    from harness.planning import plan_for, preset_config

    nodes = sections.get("hardware", {}).get("nodes", 1)
    table = tmp_path / "parallelism_data.json"
    table.write_text(json.dumps({"H100": {str(8 * nodes): entry}}))
    values = ", ".join(f"{k}={v}" for k, v in entry.items())
    reason = (
        f"file:{table}: the entry for H100 x {8 * nodes} ({values}) does not fit this run: {why}"
    )
    parallelism = {**sections.get("parallelism", {}), "table_path": str(table)}
    cfg = preset_config("mistral-7b-8xh100", **{**sections, "parallelism": parallelism})
    plan = plan_for(cfg)
    assert plan["table"] == {"status": "miss", "reason": f"{reason}; falling back to the planner"}
    assert plan["source"] == "estimated"
    config_keys = set(sections.get("parallelism", {}))
    for stage in plan["stages"].values():
        assert {k for k, v in stage["sources"].items() if v == "config"} == config_keys
        assert "file:" not in json.dumps(stage["sources"])
        layout = stage["layout"]
        assert layout["dp"] * layout["tp"] == plan["world"]
    cfg["parallelism"]["on_table_miss"] = "error"
    with pytest.raises(StageError) as err:
        plan_for(cfg)
    assert str(err.value) == reason


def test_config_values_that_cannot_fit_stay_errors_about_the_config(tmp_path: Path) -> None:
    from harness.planning import plan_for, preset_config

    table = tmp_path / "parallelism_data.json"
    table.write_text(json.dumps({"H100": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 1}}}))
    for key, value, message in [
        ("tp", 3, "parallelism.tp: must divide the attention and KV heads (dp=None, tp=3, world=8"),
        ("dp", 3, "parallelism.dp: dp * tp must equal the world size (dp=3, tp=None, world=8"),
    ]:
        cfg = preset_config("mistral-7b-8xh100", parallelism={"table_path": str(table), key: value})
        with pytest.raises(StageError, match=re.escape(message)):
            plan_for(cfg)
