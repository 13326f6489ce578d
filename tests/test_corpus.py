"""The prepare_tokenizer stage: tokenizer training and loading, sources, shards, model config."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.configs import model_settings
from harness.contracts import mismatches
from harness.datafiles import write_rows
from harness.hub import commit_sha, hub_call, serve_hub
from harness.planning import cpu_hardware, plan_for
from harness.workflow import REPO, default_config
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from stagetrain.config import validation as stconfig
from stagetrain.config.settings import DataSettings, FileData, TasksSettings, TokenizerSettings
from stagetrain.corpus import sources as corpus_sources
from stagetrain.corpus.meta import FilesRecord, GeneratedRecord, TokenizerMeta
from stagetrain.corpus.shards import token_dtype, write_split
from stagetrain.errors import StageError
from stagetrain.model.config import training_config
from stagetrain.planning.derived import vocab_padding
from stagetrain.tasks import ANSWER_TOKEN, PROBLEM_TOKEN, split_of
from stagetrain.tokenizer.build import SPECIAL_TOKENS, load_pretrained, save, train_bpe
from stagetrain.tokenizer.prepare import prepare

TEXTS = [
    "The cat sees 3 apples.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "unicode: naïve café, 東京, emoji 🙂",
    f"{PROBLEM_TOKEN}12+34{ANSWER_TOKEN}46",
    "1234567890 -42 3.14",
]


@pytest.fixture(scope="module")
def sources() -> list[corpus_sources.Source]:
    return corpus_sources.build(_data(default_config()["data"]), seed=7)


@pytest.fixture(scope="module")
def tokenizer(sources: list[corpus_sources.Source]) -> PreTrainedTokenizerFast:
    from stagetrain.tokenizer.prepare import training_sample

    return train_bpe(training_sample(sources, 0.3), 512)


def _data(section: dict[str, Any]) -> DataSettings:
    return DataSettings.from_config(section, "data")


def _files(path: Path | str, text_field: str = "text") -> FileData:
    """A data.files entry of weight 1."""
    return FileData(path=str(path), weight=1.0, text_field=text_field)


def _listed(name: str, weight: float, documents: list[str]) -> corpus_sources.Source:
    """A source of the same `documents` for either split."""
    record = FilesRecord(kind="files", path=name, weight=weight, text_field="text",
                                        files=[])  # fmt: skip
    return corpus_sources.Source(name=name, weight=weight, documents=lambda split: iter(documents),
                                 record=record)  # fmt: skip


def _small(**data: Any) -> dict[str, Any]:
    cfg = default_config()
    cfg["data"] = {**cfg["data"], "train_tokens": 20_000, "val_tokens": 2_000, **data}
    cfg["tokenizer"]["training_sample_mb"] = 0.2
    return cfg


def _prepare(cfg: dict[str, Any], out: Path, plan: dict[str, Any] | None = None) -> TokenizerMeta:
    outputs = {
        "tokenizer": str(out / "tokenizer"), "train": str(out / "data/train.bin"), "val": str(out / "data/val.bin"),
        "meta": str(out / "data/meta.json"), "model_config": str(out / "model_config.json"),
    }  # fmt: skip
    return prepare(
        cfg, tp=vocab_padding(plan or plan_for(cfg, cpu_hardware()))["tp"], outputs=outputs
    )


# --- tokenizer ------------------------------------------------------------------


def test_trained_tokenizer_round_trips_exactly_and_fits(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    assert len(tokenizer) <= 512
    save(tokenizer, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for text in TEXTS:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text
    for name, token in SPECIAL_TOKENS.items():
        assert getattr(loaded, name) == token
    assert loaded.convert_tokens_to_ids(PROBLEM_TOKEN) < 8  # special, not split into bytes
    assert len(loaded(f"{PROBLEM_TOKEN}{ANSWER_TOKEN}", add_special_tokens=False)["input_ids"]) == 2


def test_digits_are_single_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_training_is_deterministic(sources: list[corpus_sources.Source], tmp_path: Path) -> None:
    from stagetrain.tokenizer.prepare import training_sample

    hashes = {
        save(train_bpe(training_sample(sources, 0.1), 400), tmp_path / f"t{i}") for i in range(2)
    }
    assert len(hashes) == 1


def _bare_tokenizer(folder: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A 'pretrained' tokenizer with an eos but no pad token and no task markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{chr(c): i + 1 for i, c in enumerate(range(97, 123))}, "<unk>": 27}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


def _pretrained_cfg(folder: Path, **changes: Any) -> TokenizerSettings:
    section = {
        **default_config()["tokenizer"],
        "source": "pretrained",
        "path": str(folder),
        **changes,
    }
    return TokenizerSettings.from_config(section, "tokenizer")


def test_pretrained_tokenizer_gets_pad_and_markers(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    folder = _bare_tokenizer(tmp_path / "bare", tokenizer)
    loaded = load_pretrained(_pretrained_cfg(folder))
    assert loaded.pad_token == "<|pad|>" and loaded.eos_token == "<eos>"
    assert len(loaded) == 28 + 3  # pad and the two task markers added
    assert len(loaded(PROBLEM_TOKEN, add_special_tokens=False)["input_ids"]) == 1
    with_pad = load_pretrained(_pretrained_cfg(folder, pad_token="<eos>", add_special_tokens=True))
    assert with_pad.pad_token == "<eos>" and len(with_pad) == 30


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"add_special_tokens": False}, "tokenizer.add_special_tokens: false, but .* lacks pad, <\\|problem\\|>"),
        ({"pad_token": "<nope>"}, "tokenizer.pad_token: '<nope>' is not a token of"),
        ({"path": None}, "tokenizer.path: required when tokenizer.source is 'pretrained'"),
        ({"path": "/nonexistent/tokenizer/dir"}, "tokenizer.path: cannot load '/nonexistent/tokenizer/dir'"),
    ],
)  # fmt: skip
def test_pretrained_tokenizer_errors(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, changes: dict, message: str
) -> None:
    folder = _bare_tokenizer(tmp_path / "bare", tokenizer)
    with pytest.raises(StageError, match=message):
        load_pretrained(_pretrained_cfg(folder, **changes))


def test_remote_code_is_off_unless_configured(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    original = AutoTokenizer.from_pretrained

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("trust_remote_code"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    folder = _bare_tokenizer(tmp_path / "bare", tokenizer)
    load_pretrained(_pretrained_cfg(folder))
    load_pretrained(_pretrained_cfg(folder, trust_remote_code=True))
    assert seen == [False, True]


# --- sources ---------------------------------------------------------------------


def test_generated_problems_stay_in_their_split(sources: list[corpus_sources.Source]) -> None:
    pattern = re.compile(re.escape(PROBLEM_TOKEN) + "(.*?)" + re.escape(ANSWER_TOKEN))
    for split in ("train", "val"):
        documents = [d for _, d in zip(range(3000), sources[0].documents(split), strict=False)]
        questions = [m.group(1) for d in documents if (m := pattern.search(d))]
        assert len(questions) > 2000
        assert {split_of(q) for q in questions} == {split}
    again = [d for _, d in zip(range(50), sources[0].documents("train"), strict=False)]
    assert again == [
        d
        for _, d in zip(
            range(50),
            corpus_sources.build(_data(default_config()["data"]), 7)[0].documents("train"),
            strict=False,
        )
    ]


CORPUS_KINDS = (".jsonl.gz", ".jsonl.zst", ".parquet")


@pytest.mark.parametrize("kind", CORPUS_KINDS)
def test_compressed_and_parquet_corpora_read_as_their_json_lines(tmp_path: Path, kind: str) -> None:
    """The same rows, in the formats hub corpora come in, give the same documents in the same
    splits as plain JSON lines, through the task files' reader; other columns are ignored."""
    rows = [{"id": i, "body": f"document {i} of the corpus."} for i in range(300)]

    def documents(name: str) -> tuple[list[str], list[str]]:
        write_rows(
            tmp_path / name / f"part{kind if name == 'other' else '.jsonl'}",
            rows,
            row_group_size=64,
        )
        source = corpus_sources.files(_files(tmp_path / name / "*", "body"), 0, 0.25)
        return list(source.documents("train")), list(source.documents("val"))

    plain, other = documents("plain"), documents("other")
    assert other == plain and len(plain[0]) + len(plain[1]) == 300 and plain[1]


def test_a_cut_compressed_corpus_file_stops_the_stage_rather_than_adding_nothing(
    tmp_path: Path,
) -> None:
    """A corpus .zst or .gz cut by one byte is one line naming it; it must not read as a
    file of no documents, which the stage would count as 0 tokens and carry on."""
    rows = [{"text": f"document {i} of the corpus."} for i in range(300)]
    for kind, message in (
        (".jsonl.zst", "truncated zstd stream"),
        (".jsonl.gz", "Compressed file ended"),
    ):
        path = write_rows(tmp_path / f"part{kind}", rows)
        path.write_bytes(path.read_bytes()[:-1])
        source = corpus_sources.files(_files(path), 0, 0.25)
        with pytest.raises(StageError, match=re.escape(f"{path}: cannot read ({message}")):
            list(source.documents("train"))


@pytest.mark.parametrize(
    ("kind", "rows", "message"),
    [
        (".parquet", [{"body": "a"}], "part.parquet: no column 'text' (it has: body); set text_field to the one that holds the text"),
        (".parquet", [{"text": 3}], "part.parquet: column 'text' holds int64, not text (a string column)"),
        (".parquet", [{"text": "a"}, {"text": None}], "part.parquet:row 2: column 'text' is null, not text"),
        (".jsonl.zst", [{"text": "a"}, {"body": "b", "id": 2}], "part.jsonl.zst:2: no field 'text' (it has: body, id); set text_field to the one that holds the text"),
        (".jsonl.gz", [{"text": ["a"]}], "part.jsonl.gz:1: field 'text' holds list, not text"),
    ],
    ids=["parquet-no-column", "parquet-int-column", "parquet-null", "zst-no-field", "gz-list"],
)  # fmt: skip
def test_a_corpus_file_without_its_text_is_one_line_naming_file_and_row(
    tmp_path: Path, kind: str, rows: list[dict[str, Any]], message: str
) -> None:
    write_rows(tmp_path / f"part{kind}", rows)
    source = corpus_sources.files(_files(tmp_path / f"part{kind}"), 0, 0.0)
    with pytest.raises(StageError) as err:
        list(source.documents("train"))
    assert str(err.value) == f"{tmp_path}/{message}"


def test_file_sources_read_txt_and_jsonl_with_a_stable_split(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a whole file is one document")
    rows = [json.dumps({"text": f"line document {i}"}) for i in range(200)]
    (tmp_path / "b.jsonl").write_text("\n".join(rows) + "\n\n")
    source = corpus_sources.files(_files(tmp_path / "*"), 0, 0.25)
    train, val = list(source.documents("train")), list(source.documents("val"))
    assert len(train) + len(val) == 201 and not set(train) & set(val)
    assert 20 < len(val) < 80
    assert val == [d for d in list(source.documents("val"))]
    assert source.record["files"] == [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    assert mismatches(dict(source.record), FilesRecord) == []


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "ok"}\n{not json}\n', "bad.jsonl:2: invalid JSON"),
        (
            "bad.jsonl",
            '{"text": "ok"}\n\n{"body": "x"}\n',
            "bad.jsonl:3: no field 'text' (it has: body); set text_field to the one that holds the text",
        ),
        (
            "bad.csv",
            "a,b\n",
            "bad.csv: expected a .txt file or one of .jsonl, .jsonl.gz, .jsonl.zst, .json, .parquet",
        ),
    ],
)
def test_bad_files_name_the_file_and_line(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    (tmp_path / name).write_text(content)
    source = corpus_sources.files(_files(tmp_path / name), 0, 0.1)
    with pytest.raises(StageError, match=re.escape(message)):
        list(source.documents("train"))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin1.txt", "caf\u00e9 au lait".encode("latin-1"), "latin1.txt: not UTF-8 text (byte 0xe9 at byte offset 3)"),
        ("latin1.jsonl", b'{"text": "ok"}\n{"text": "na\xefve"}\n', "latin1.jsonl:2: not UTF-8 text (byte 0xef at byte offset 27)"),
        ("cut.jsonl", '{"text": "\u00e9"}'.encode()[:-3] + b'"}\n', "cut.jsonl:1: not UTF-8 text (byte 0xc3 at byte offset 10)"),
    ],
    ids=["txt", "jsonl", "truncated-sequence"],
)  # fmt: skip
def test_a_file_that_is_not_utf8_names_the_file_and_byte(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    (tmp_path / name).write_bytes(content)
    source = corpus_sources.files(_files(tmp_path / name), 0, 0.1)
    with pytest.raises(StageError) as err:
        list(source.documents("train"))
    assert str(err.value) == f"{tmp_path}/{message}"


def test_txt_files_read_with_the_newlines_of_text_mode(tmp_path: Path) -> None:
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\rthree\n")
    source = corpus_sources.files(_files(tmp_path / "crlf.txt"), 0, 0.0)
    assert list(source.documents("train")) == ["one\ntwo\nthree\n"]


def test_a_glob_matching_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"data.files.3.path: '.*nothing\*' matches no file"):
        corpus_sources.files(_files(tmp_path / "nothing*"), 3, 0.1)


def test_unknown_family_and_no_source_are_errors() -> None:
    data = default_config()["data"]
    with pytest.raises(StageError, match="data.generated.families: unknown family 'poetry'"):
        corpus_sources.build(
            _data({**data, "generated": {**data["generated"], "families": ["poetry"]}}), 1
        )
    with pytest.raises(StageError, match="data: no source"):
        corpus_sources.build(_data({**data, "generated": {**data["generated"], "weight": 0}}), 1)


# --- shards ------------------------------------------------------------------------


def test_token_dtype_is_checked() -> None:
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_shard_readback_equals_the_token_stream(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    docs = [f"document number {i} with {i * 7} items." for i in range(5000)]
    source = _listed("list", 1.0, docs)
    eos = tokenizer.eos_token_id
    path = tmp_path / "train.bin"
    written = write_split(
        tokenizer.backend_tokenizer,
        [source],
        "train",
        20_000,
        path,
        eos_id=eos,
        dtype=np.dtype(np.uint16),
    )
    shard = np.memmap(path, dtype=np.uint16, mode="r")
    expected, last = [], []
    for doc in docs[: written[0].documents]:
        last = tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]
        expected += last
    assert shard.tolist() == expected
    assert written[0].tokens == len(expected) >= 20_000
    assert len(expected) - len(last) < 20_000  # stops at the first whole document past the budget


def test_weights_split_the_tokens(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    def make(word: str, weight: float) -> corpus_sources.Source:
        return _listed(word, weight, [f"{word} {i}" for i in range(10**5)])

    written = write_split(tokenizer.backend_tokenizer, [make("alpha", 3.0), make("beta", 1.0)], "train", 40_000,
                          tmp_path / "t.bin", eos_id=tokenizer.eos_token_id, dtype=np.dtype(np.uint16))  # fmt: skip
    assert 29_990 <= written[0].tokens < 30_020 and 9_990 <= written[1].tokens < 10_020


def test_a_short_source_is_read_again_to_fill_its_share(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights mean shares: a source that runs out starts over (stopping short left it 1/7 of
    the split at weight 1 of 2), says so, and counts it; one far too small is refused."""
    short = _listed("short", 1.0, [f"short document {i}" for i in range(40)])
    once = sum(
        len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1
        for d in short.documents("train")
    )
    long = _listed("long", 1.0, [f"long {i}" for i in range(10**5)])
    with caplog.at_level("INFO", logger="stagetrain"):
        written = write_split(tokenizer.backend_tokenizer, [short, long], "train", 8 * once, tmp_path / "t.bin",
                              eos_id=tokenizer.eos_token_id, dtype=np.dtype(np.uint16))  # fmt: skip
    assert 4 * once <= written[0].tokens < 4 * once + 10 and written[0].repeats == 3
    assert written[0].documents == 4 * 40 and 4 * once <= written[1].tokens < 4 * once + 10
    assert "short train: its documents were read 4 times" in caplog.text
    shard = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")[: 2 * once].tolist()
    assert shard[:once] == shard[once:]  # the same documents, in the same order, again
    tiny = _listed("tiny", 1.0, ["only one"])
    with pytest.raises(
        StageError,
        match=r"^tiny: its val documents hold \d+ tokens, which would be read [\d,]+ times",
    ):
        write_split(tokenizer.backend_tokenizer, [tiny], "val", 10_000, tmp_path / "v.bin",
                    eos_id=tokenizer.eos_token_id, dtype=np.dtype(np.uint16))  # fmt: skip


# --- the whole stage -------------------------------------------------------------


def test_prepare_writes_everything_and_reruns_byte_identical(tmp_path: Path) -> None:
    cfg = _small()
    first = _prepare(cfg, tmp_path / "a")
    second = _prepare(cfg, tmp_path / "b")
    assert first == second
    for rel in ("data/train.bin", "data/val.bin", "data/meta.json", "model_config.json", "tokenizer/tokenizer.json",
                "tokenizer/tokenizer_config.json"):  # fmt: skip
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (
        first["dtype"] == "uint16"
        and first["train"]["tokens"] >= 20_000
        and first["val"]["tokens"] >= 2_000
    )
    train = np.memmap(tmp_path / "a/data/train.bin", dtype=np.uint16, mode="r")
    assert len(train) == first["train"]["tokens"] and train[-1] == first["eos_token_id"]
    model_config = json.loads((tmp_path / "a/model_config.json").read_text())
    assert (
        model_config["vocab_size"] == 512 and model_config["eos_token_id"] == first["eos_token_id"]
    )
    assert not [
        p for p in (tmp_path / "a").rglob(".*") if p.name != ".snakemake_timestamp"
    ]  # no temp files left
    assert mismatches(json.loads((tmp_path / "a/data/meta.json").read_text()), TokenizerMeta) == []


def test_vocab_is_padded_for_the_plans_tp(tmp_path: Path) -> None:
    cfg = _small()
    plan = plan_for(cfg, cpu_hardware())
    plan["stages"]["grpo"]["layout"]["tp"] = 4
    meta = _prepare(cfg, tmp_path, plan)
    assert meta["model_vocab_size"] == 512 and meta["model_vocab_size"] % 256 == 0
    cfg["tokenizer"]["vocab_size"] = 700
    meta = _prepare(cfg, tmp_path / "big", plan)
    assert meta["tokenizer_size"] <= 700 and meta["model_vocab_size"] == 768


def test_tokenizer_larger_than_planned_is_an_error(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    cfg = _small()
    folder = tmp_path / "tok"
    save(tokenizer, folder)
    cfg["tokenizer"] = {
        **cfg["tokenizer"],
        "source": "pretrained",
        "path": str(folder),
        "vocab_size": 300,
    }
    with pytest.raises(
        StageError, match="tokenizer.vocab_size: 300, but the tokenizer has 512 tokens"
    ):
        _prepare(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _init_model(tmp_path: Path, vocab: int) -> Path:
    folder = tmp_path / "init"
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_continued_model_grows_or_refuses(tmp_path: Path) -> None:
    folder = _init_model(tmp_path, 300)
    model = {**stconfig.validate({})["model"], "init_from": str(folder)}
    ids = {"eos_token_id": 1}
    assert (
        training_config(model_settings(model), tokenizer_size=512, special_ids=ids, tp=2).vocab_size
        == 512
    )
    assert (
        training_config(model_settings(model), tokenizer_size=200, special_ids=ids, tp=1).vocab_size
        == 320
    )
    with pytest.raises(
        StageError,
        match="model.resize_embeddings: false, but the tokenizer has 512 tokens .* only 300",
    ):
        training_config(
            model_settings({**model, "resize_embeddings": False}),
            tokenizer_size=512,
            special_ids=ids,
            tp=1,
        )
    assert (
        training_config(
            model_settings({**model, "resize_embeddings": False}),
            tokenizer_size=200,
            special_ids=ids,
            tp=1,
        ).vocab_size
        == 300
    )
    with pytest.raises(StageError, match="model.architecture: 'mixtral' but .* is a 'llama' model"):
        training_config(
            model_settings({**model, "architecture": "mixtral"}),
            tokenizer_size=200,
            special_ids=ids,
            tp=1,
        )


def test_hub_dataset_source_through_a_loopback_hub(tmp_path: Path) -> None:
    """The real huggingface_hub client fetches dataset files, JSON lines and parquet; meta
    records the commit."""
    rows = "".join(
        json.dumps({"text": f"hub document {i} says hello."}) + "\n" for i in range(3000)
    )
    parquet = write_rows(
        tmp_path / "more.parquet", [{"text": f"parquet row {i}."} for i in range(500)]
    )
    sha = commit_sha("corpus")
    cfg_path = tmp_path / "config.yaml"
    raw = stconfig.load_yaml(REPO / "config" / "config.yaml")
    raw["data"] = {"train_tokens": 5000, "val_tokens": 500, "generated": {"weight": 1.0},
                   "hub": [{"repo": "org/corpus", "files": ["train.jsonl", "more.parquet"], "weight": 1.0}]}  # fmt: skip
    raw["tokenizer"]["training_sample_mb"] = 0.1
    import yaml

    cfg_path.write_text(yaml.safe_dump(raw))
    plan = tmp_path / "vocab.json"
    plan.write_text(json.dumps(vocab_padding(plan_for(stconfig.load(cfg_path), cpu_hardware()))))
    out = tmp_path / "out"
    files = {"train.jsonl": rows.encode(), "more.parquet": parquet.read_bytes()}
    with serve_hub({"datasets/org/corpus": {"main": (sha, files)}}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(
            HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1"
        )
        cmd = [sys.executable, str(REPO / "scripts/prepare_tokenizer.py"), "--config", str(cfg_path), "--vocab", str(plan),
               "--tokenizer", str(out / "tok"), "--train", str(out / "train.bin"), "--val", str(out / "val.bin"),
               "--meta", str(out / "meta.json"), "--model-config", str(out / "mc.json")]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    hub_source = meta["sources"][1]
    assert hub_source["name"] == "hub:org/corpus" and hub_source["record"]["commit"] == sha
    assert hub_source["train_tokens"] >= 2500 and hub_source["val_tokens"] > 0
    for name in files:
        assert any(f"/datasets/org/corpus/resolve/main/{name}" in r.path for r in hub.requests)

    proc = subprocess.run(
        cmd,
        env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, "the cached file serves a rerun without the hub"
    raw["data"]["hub"][0]["repo"] = "org/missing"
    cfg_path.write_text(yaml.safe_dump(raw))
    with serve_hub({}) as hub:
        proc = subprocess.run(
            cmd,
            env={**env, "HF_ENDPOINT": hub.endpoint},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: data.hub.0: hub dataset 'org/missing'@main: repository not found (or private without a token)"
    )


def test_task_families_join_the_corpus_in_their_split(tmp_path: Path) -> None:
    """A tasks family the corpus names gives training text of its own split only, at levels up
    to data.generated.max_level; the record says where its problems came from."""
    from stagetrain.tasks.families import load_tasks

    rows = [
        {"prompt": f"capital of country {i}?", "answer": f"city {i}", "level": 1 + i % 3}
        for i in range(1200)
    ]
    (tmp_path / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = default_config()
    config["tasks"] = {
        "families": [{"name": "capitals", "files": [str(tmp_path / "capitals.jsonl")]}]
    }
    config["data"]["generated"].update(families=["arithmetic", "capitals"], prose_share=0.0)
    config = stconfig.validate(config)
    tasks = load_tasks(TasksSettings.from_config(config["tasks"], "tasks"))
    source = corpus_sources.build(_data(config["data"]), seed=3, tasks=tasks)[0]
    pattern = re.compile(
        re.escape(PROBLEM_TOKEN) + "(capital of country (\\d+)\\?)" + re.escape(ANSWER_TOKEN)
    )
    for split in ("train", "val"):
        docs = [d for _, d in zip(range(2000), source.documents(split), strict=False)]
        mine = [m for d in docs if (m := pattern.search(d))]
        assert len(mine) > 500, split
        assert {split_of(m.group(1)) for m in mine} == {split}
        assert {1 + int(m.group(2)) % 3 for m in mine} == {1, 2}  # level 3 is above max_level 2
    assert mismatches(dict(source.record), GeneratedRecord) == []
    record = source.record["tasks"]["capitals"]
    assert record["files"] == [{"path": str(tmp_path / "capitals.jsonl")}]
    assert sum(record["problems"]["1"].values()) == 400


def test_level_weights_set_the_levels_shares_in_the_corpus(tmp_path: Path) -> None:
    """data.generated.level_weights draws levels in its proportions (the default run's lever for
    how much of level 2 pretraining sees), and a family whose levels here all weigh 0 is one
    line."""
    from stagetrain.tasks.families import load_tasks

    rows = [{"prompt": f"capital of country {i}?", "answer": f"city {i}", "level": 1 + i % 2}
            for i in range(400)]  # fmt: skip
    (tmp_path / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pattern = re.compile(re.escape(PROBLEM_TOKEN) + "capital of country (\\d+)\\?")

    def levels(weights: list[float] | None, max_level: int = 2) -> list[int]:
        config = default_config()
        config["tasks"] = {
            "families": [{"name": "capitals", "files": [str(tmp_path / "capitals.jsonl")]}]
        }
        config["data"]["generated"].update(families=["capitals"], prose_share=0.0,
                                           max_level=max_level, level_weights=weights)  # fmt: skip
        config = stconfig.validate(config)
        tasks = load_tasks(TasksSettings.from_config(config["tasks"], "tasks"))
        source = corpus_sources.build(_data(config["data"]), seed=3, tasks=tasks)[0]
        assert source.record["level_weights"] == weights
        docs = itertools.islice(source.documents("train"), 2000)
        return [1 + int(m.group(1)) % 2 for d in docs if (m := pattern.search(d))]

    drawn = levels([3, 1])
    assert 2.6 < drawn.count(1) / drawn.count(2) < 3.4, (drawn.count(1), drawn.count(2))
    assert set(levels([0, 1])) == {2}
    equal = levels(None)
    assert 0.85 < equal.count(1) / equal.count(2) < 1.15
    with pytest.raises(StageError) as err:  # capitals has levels 1 and 2 only
        levels([0, 0, 1], max_level=3)
    assert str(err.value) == (
        "data.generated.level_weights: family 'capitals' has levels 1..2 here, and their weights [0, 0] are all 0"
    )


# --- failures leave nothing behind ----------------------------------------------


def _good_rows_then_a_bad_line(path: Path, rows: int) -> None:
    good = "".join(
        json.dumps({"text": f"document number {i} is here."}) + "\n" for i in range(rows)
    )
    path.write_text(good + "{not json}\n")


def test_a_bad_line_found_while_tokenising_leaves_no_temp_file(tmp_path: Path) -> None:
    # More good documents than one tokenisation batch (4096) before the bad line, so a
    # partial train shard has been written when it is found; the BPE sample stops earlier.
    corpus = tmp_path / "corpus.jsonl"
    _good_rows_then_a_bad_line(corpus, 5000)
    cfg = _small(
        train_tokens=200_000,
        generated={**default_config()["data"]["generated"], "weight": 0},
        files=[{"path": str(corpus), "weight": 1.0, "text_field": "text"}],
    )
    cfg["tokenizer"]["training_sample_mb"] = 0.05
    out = tmp_path / "out"
    with pytest.raises(StageError, match=re.escape(f"{corpus}:5001: invalid JSON")):
        _prepare(cfg, out)
    assert sorted(p.name for p in (out / "data").iterdir()) == []
    assert not (out / "tokenizer").exists() and not (out / "model_config.json").exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs, to fill for real (needs root and permission to mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small tmpfs")
    cmd = ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill: {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_one_line_and_leaves_no_temp_file(small_disk: Path) -> None:
    # 20,000 uint16 tokens (40 KB) do not fit in 16 KiB.
    out = small_disk / "run"
    with pytest.raises(StageError) as err:
        _prepare(_small(), out)
    assert str(err.value) == f"no space left on {out / 'data'} (writing train.bin)"
    assert list((out / "data").iterdir()) == []
    assert not (out / "tokenizer").exists()


HUB_SOURCE = """
import json, sys, time
from stagetrain.corpus import sources
from stagetrain.errors import StageError
from stagetrain.config.settings import HubData
cfg = HubData(repo="org/corpus", revision="main", files=("train.jsonl",), weight=1.0, text_field="text")
start = time.monotonic()
try:
    result = {"record": sources.hub(cfg, 0, 0.1).record}
except StageError as err:
    result = {"error": str(err)}
print(json.dumps({**result, "seconds": time.monotonic() - start}))
"""


def test_a_slow_hub_dataset_is_a_one_line_error_within_the_time_limit(tmp_path: Path) -> None:
    files = {"train.jsonl": json.dumps({"text": "hello"}).encode() + b"\n"}
    repos = {"datasets/org/corpus": {"main": (commit_sha("corpus"), files)}}
    with serve_hub(repos, delay_s=30) as hub:
        result = hub_call(tmp_path, hub.endpoint, [], code=HUB_SOURCE, timeout_s=1.5)
    assert result.pop("seconds") < 1.5 + 1.0
    assert result == {
        "error": "data.hub.0: hub dataset 'org/corpus'@main: hub unreachable (ReadTimeout; gave up "
        "within the 1.5 s limit of STAGETRAIN_HUB_TIMEOUT_S) and train.jsonl not in the cache"
    }


def test_control_token_text_in_corpus_files_stays_text(tmp_path: Path) -> None:
    """A corpus file's "<|eos|>" or "<|problem|>" is text: encoded as the special ids, it split
    documents mid-text and made fake tasks. train.bin, decoded, holds the file's text as written,
    and the only special ids in the file's share are the eos after each document."""
    text = "a <|eos|> b <|problem|>1+1<|answer|>3 c <|pad|> d <|bos|>"
    (tmp_path / "odd.jsonl").write_text(json.dumps({"text": text}) + "\n")
    cfg = _small(generated={**default_config()["data"]["generated"], "weight": 0.0},
                 files=[{"path": str(tmp_path / "odd.jsonl"), "weight": 1.0, "text_field": "text"}],
                 train_tokens=2_000, val_tokens=0)  # fmt: skip
    meta = _prepare(cfg, tmp_path / "out")
    ids = np.fromfile(tmp_path / "out/data/train.bin", dtype=meta["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out/tokenizer")
    special = set(tokenizer.all_special_ids)
    eos = tokenizer.eos_token_id
    documents = [
        list(g) for is_eos, g in itertools.groupby(ids.tolist(), lambda i: i == eos) if not is_eos
    ]
    assert documents and all(not special & set(d) for d in documents)
    assert {tokenizer.decode(d) for d in documents} == {text}
