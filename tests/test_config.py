"""The config schema and its validation: every key described, unknown keys and bad values rejected in one line."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.configs import model_settings
from harness.workflow import REPO, checked, default_config
from snakemake.utils import validate as snakemake_validate

from stagetrain.config import validation as stconfig
from stagetrain.errors import StageError
from stagetrain.model.config import build_config

PRESETS = sorted((REPO / "config" / "presets").glob("*.yaml"))


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (dotted path, subschema) of an object schema, following $ref into $defs."""
    defs = stconfig.schema()["$defs"]
    out = []
    for key, sub in schema.get("properties", {}).items():
        dotted = f"{path}.{key}" if path else key
        target = defs[sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub
        out.append((dotted, {**target, **{k: v for k, v in sub.items() if k != "$ref"}}))
        if target.get("type") == "object":
            out.extend(_walk(target, dotted))
        if target.get("type") == "array" and "properties" in target.get("items", {}):
            out.append((f"{dotted}[]", target["items"]))
            out.extend(_walk(target["items"], f"{dotted}[]"))
    return out


def test_schema_sections_are_the_documented_ones() -> None:
    assert tuple(stconfig.schema()["properties"]) == stconfig.SECTIONS


def test_every_key_is_described_typed_and_closed() -> None:
    for dotted, sub in _walk(stconfig.schema()):
        assert sub.get("description"), f"{dotted} has no description"
        assert "type" in sub or "enum" in sub, f"{dotted} has no type or enum"
        if sub.get("type") == "object":
            assert sub.get("additionalProperties") is False, f"{dotted} accepts unknown keys"
    assert stconfig.schema()["additionalProperties"] is False


@pytest.mark.parametrize("path", [REPO / "config" / "config.yaml", *PRESETS], ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    config = stconfig.load(path)
    assert set(config) == set(stconfig.SECTIONS)


def test_defaults_are_filled_at_every_level() -> None:
    config = checked({"grpo": {"optimizer": {"lr": 0.5}}})
    assert config["grpo"]["optimizer"] == {
        "lr": 0.5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "schedule": "cosine",
        "warmup_steps": 10, "min_lr_ratio": 0.1, "grad_clip": 1.0,
    }  # fmt: skip
    assert config["pretrain"]["optimizer"]["lr"] == 1e-3
    assert config["parallelism"]["on_table_miss"] == "planner"


def test_defaults_are_not_shared_between_validations() -> None:
    first = checked({})
    first["pretrain"]["optimizer"]["betas"].append(0.5)
    assert checked({})["pretrain"]["optimizer"]["betas"] == [0.9, 0.95]


def test_snakemake_validate_fills_the_same_defaults() -> None:
    """The Snakefile uses snakemake.utils.validate; scripts use ours: same result."""
    raw = {"pretrain": {"steps": 17}, "grpo": {}}
    ours = checked(raw)
    theirs = copy.deepcopy(raw)
    snakemake_validate(theirs, str(stconfig.SCHEMA_PATH))
    assert theirs == ours


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"bogus": {}}, "config: bogus: unknown key (allowed here: consolidate, data,"),
        ({"pretrain": {"stepz": 3}}, "config: pretrain.stepz: unknown key"),
        ({"grpo": {"optimizer": {"lrr": 1}}}, "config: grpo.optimizer.lrr: unknown key"),
        ({"pretrain": {"steps": "ten"}}, "config: pretrain.steps: expected integer, got 'ten'"),
        ({"pretrain": 5}, "config: pretrain: expected object, got 5"),
        ({"parallelism": {"micro_batch_size": 0}}, "config: parallelism.micro_batch_size: expected a value >= 1, got 0"),
        ({"parallelism": {"zero_stage": 4}}, "config: parallelism.zero_stage: expected a value <= 3, got 4"),
        ({"deepspeed": {"precision": "fp8"}}, "config: deepspeed.precision: expected one of 'auto', 'bf16', 'fp16', 'fp32', got 'fp8'"),
        ({"run": {"name": "../escape"}}, "config: run.name: expected a string matching"),
        ({"run": {"name": "a" * 300}}, "config: run.name: expected at most 100 characters, got 300"),
        ({"pretrain": {1: 2, "stepz": 3}}, "config: pretrain.1: unknown key"),  # a number key: no TypeError
    ],
)  # fmt: skip
def test_bad_values_are_one_line_errors_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(StageError) as err:
        checked(raw)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_duplicate_yaml_keys_are_rejected_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("run:\n  name: a\npretrain:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(StageError, match=r"dup.yaml:5: duplicate key 'steps' \(first at line 4\)"):
        stconfig.load(path)


def test_yaml_merge_keys_are_read_and_explicit_keys_win(tmp_path: Path) -> None:
    """`<<: *anchor` is YAML Snakemake accepts; the strict loader refused it as invalid."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        "base: &b\n  lr: 1.0e-3\n  warmup_steps: 5\noptimizer:\n  <<: *b\n  lr: 2.0e-3\n"
    )
    assert stconfig.load_yaml(path)["optimizer"] == {"lr": 2.0e-3, "warmup_steps": 5}
    path.write_text("base: &b\n  lr: 1.0e-3\noptimizer:\n  <<: *b\n  lr: 2.0e-3\n  lr: 3.0e-3\n")
    with pytest.raises(StageError, match=r"merge.yaml:6: duplicate key 'lr' \(first at line 5\)"):
        stconfig.load_yaml(path)


def test_invalid_yaml_and_missing_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(StageError, match=r"bad.yaml:\d+: invalid YAML"):
        stconfig.load(bad)
    with pytest.raises(StageError, match="nope.yaml: file not found"):
        stconfig.load(tmp_path / "nope.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(StageError, match="expected a mapping of config sections, got list"):
        stconfig.load(listed)


def _keys_of_type(kind: str) -> list[tuple[str, dict[str, Any]]]:
    """Every (dotted key, subschema) whose type is or includes `kind`, outside arrays of objects."""
    out = []
    for dotted, sub in _walk(stconfig.schema()):
        kinds = sub.get("type", [])
        if "[]" not in dotted and kind in (kinds if isinstance(kinds, list) else [kinds]):
            out.append((dotted, sub))
    return out


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


INTEGER_KEYS = _keys_of_type("integer")


def test_the_integer_keys_are_found() -> None:
    names = {dotted for dotted, _ in INTEGER_KEYS}
    assert {
        "tokenizer.vocab_size",
        "hardware.cpu_ranks",
        "parallelism.dp",
        "grpo.optimizer.warmup_steps",
    } <= names
    assert len(names) > 40


@pytest.mark.parametrize(("dotted", "sub"), INTEGER_KEYS, ids=[d for d, _ in INTEGER_KEYS])
def test_a_whole_number_float_is_refused_for_every_integer_key(
    dotted: str, sub: dict[str, Any]
) -> None:
    """JSON Schema counts 512.0 as an integer; the stages count with it and crash, so it is refused."""
    whole = max(sub.get("minimum", 1), 1)
    whole = min(whole, sub.get("maximum", whole))
    if dotted == "model.max_position_embeddings":
        whole = 4096  # at least the default sequence lengths (test_settings_that_would_truncate...)
    if dotted in ("pretrain.steps", "grpo.steps"):
        whole = 10  # at least the default warmup (the same test)
    checked(_nested(dotted, whole))  # the same number as an int is fine
    with pytest.raises(StageError) as err:
        checked(_nested(dotted, float(whole)))
    assert str(err.value).startswith(f"config: {dotted}: expected integer")
    assert str(err.value).endswith(f"got {float(whole)!r}") and "\n" not in str(err.value)


NUMBER_KEYS = _keys_of_type("number")


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"]
)
def test_a_non_finite_number_is_refused_for_every_number_key(bad: float) -> None:
    """JSON Schema's bounds are comparisons, which NaN passes: `grpo.temperature: .nan` trained
    to rc 0 on one repeated token, and a NaN lr reached the DeepSpeed config."""
    assert {"grpo.temperature", "pretrain.optimizer.lr", "grpo.curriculum.promote_at", "grpo.tree.uct_c"} <= {
        d for d, _ in NUMBER_KEYS
    }  # fmt: skip
    for dotted, _ in NUMBER_KEYS:
        with pytest.raises(StageError) as err:
            checked(_nested(dotted, bad))
        message = str(err.value)
        assert message.startswith(f"config: {dotted}: expected a finite number"), message
        assert message.endswith(f", got {bad!r}") and "\n" not in message


def test_the_seed_is_bounded_to_what_every_generator_takes() -> None:
    with pytest.raises(
        StageError, match=r"^config: run.seed: expected a value <= 4294967295, got 10{23}$"
    ):
        checked({"run": {"seed": 10**23}})


PATTERN_KEYS = [(dotted, sub) for dotted, sub in _walk(stconfig.schema()) if "pattern" in sub]


def test_the_pattern_keys_are_found() -> None:
    assert {dotted for dotted, _ in PATTERN_KEYS} == {
        "run.name",
        "tasks.families[].name",
        "consolidate.max_shard_size",
        "publish.repo",
        "publish.license",
    }


def _with_value(dotted: str, value: str) -> tuple[dict[str, Any], str]:
    """A config holding `value` at `dotted` (a list item's key in a first item), and its key."""
    if dotted == "tasks.families[].name":
        return {
            "tasks": {"families": [{"name": value, "files": ["x.jsonl"]}]}
        }, "tasks.families.0.name"
    return _nested(dotted, value), dotted


@pytest.mark.parametrize(("dotted", "sub"), PATTERN_KEYS, ids=[d for d, _ in PATTERN_KEYS])
def test_every_pattern_must_match_the_whole_string(dotted: str, sub: dict[str, Any]) -> None:
    """Python's `$` matches before a final newline: "tiny\\n" would name a results folder."""
    good = {"publish.repo": "me/mine", "publish.license": "apache-2.0"}.get(dotted) or sub.get(
        "default", "mine"
    )
    checked(_with_value(dotted, good)[0])
    config, key = _with_value(dotted, good + "\n")
    with pytest.raises(StageError, match=f"^config: {re.escape(key)}: expected a string matching"):
        checked(config)


@pytest.mark.parametrize(
    ("families", "message"),
    [
        (["counting", "comparsion"], "unknown family 'comparsion' (known: arithmetic, counting, comparison; your own go in tasks.families)"),
        (["counting", "counting"], "'counting' is listed twice"),
    ],
)  # fmt: skip
def test_curriculum_families_are_checked_with_the_config(families: list[str], message: str) -> None:
    """A typo used to surface only when GRPO started, minutes into a run, without naming the key."""
    with pytest.raises(StageError) as err:
        checked({"grpo": {"curriculum": {"families": families}}})
    assert str(err.value) == f"config: grpo.curriculum.families: {message}"


def test_config_files_that_are_no_mapping_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "latin1.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    for name, message in [("empty.yaml", "empty config file"), ("folder.yaml", "is a folder, not a file"),
                          ("latin1.yaml", "not UTF-8 text")]:  # fmt: skip
        with pytest.raises(StageError, match=f"{name}: {message}"):
            stconfig.load(tmp_path / name)


def test_validate_section_checks_one_section() -> None:
    assert stconfig.validate_section("run", {"name": "x"}) == {"name": "x", "seed": 1234}
    with pytest.raises(StageError, match="config: run.nme: unknown key"):
        stconfig.validate_section("run", {"nme": "x"})
    with pytest.raises(StageError, match="unknown section 'runs'"):
        stconfig.validate_section("runs", {})


DEEPSEEK = {"architecture": "deepseek_v3", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64,
            "num_shared_experts": 1, "first_dense_layers": 1, "num_kv_heads": 4}  # fmt: skip
"""The default model as a deepseek_v3: its shape keys and the MoE keys it requires."""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "model.hidden_size: required for a from-scratch llama model"),
        ({"num_heads": 5}, "model.num_heads: 5 must divide model.hidden_size 128"),
        ({"num_kv_heads": 3}, "model.num_kv_heads: 3 must divide model.num_heads 4"),
        ({"num_experts": 4}, "model.num_experts: not used by architecture 'llama'"),
        ({"architecture": "mixtral"}, "model.num_experts: required for a from-scratch mixtral model"),
        ({"architecture": "mixtral", "num_experts": 2, "experts_per_token": 3}, "model.experts_per_token: 3 exceeds"),
        ({"init_from": "some/model"}, "model.hidden_size: not allowed with model.init_from"),
        ({"architecture": "deepseek_v3", "num_kv_heads": 4}, "model.num_experts: required for a from-scratch deepseek_v3 model"),
        ({**DEEPSEEK, "num_kv_heads": 2}, "model.num_kv_heads: deepseek_v3's latent attention has one key and value per query head: expected model.num_heads"),
        ({**DEEPSEEK, "num_heads": 64, "num_kv_heads": 64}, "model.num_heads: deepseek_v3 gives half of each head's hidden_size / num_heads = 2 dimensions"),
        ({**DEEPSEEK, "first_dense_layers": 4}, "model.first_dense_layers: 4 leaves no MoE layer of model.num_layers 4"),
        ({**DEEPSEEK, "router_aux_loss_coef": 0.01}, "model.router_aux_loss_coef: transformers defines no load-balancing loss for deepseek_v3"),
        ({**DEEPSEEK, "num_experts": 2, "experts_per_token": 3}, "model.experts_per_token: 3 exceeds"),
        ({"architecture": "mixtral", "num_experts": 4, "experts_per_token": 2, "router_bias_update_rate": 0.01},
         "model.router_bias_update_rate: not used by architecture 'mixtral'"),
        ({"router_bias_update_rate": 0.01}, "model.router_bias_update_rate: not used by architecture 'llama'"),
        ({"architecture": "qwen2_moe", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64,
          "num_shared_experts": 1}, "model.num_shared_experts: not used by architecture 'qwen2_moe'"),
        ({"architecture": "mixtral", "num_experts": 4, "experts_per_token": 2, "first_dense_layers": 1},
         "model.first_dense_layers: not used by architecture 'mixtral'"),
    ],
)  # fmt: skip
def test_model_shape_errors(change: dict[str, Any], message: str) -> None:
    model = {**default_config()["model"], **change}
    model = {k: v for k, v in model.items() if v is not None or k == "init_from"}
    with pytest.raises(StageError, match=message.replace("(", r"\(")):
        build_config(model_settings(model), 512)


def test_a_deepseek_v3_model_is_built_with_its_latent_attention_and_routing_bias() -> None:
    """The keys reach DeepseekV3Config under its own names; the latent attention's dimensions
    follow head_dim = hidden / heads = 32 (`model.config.latent_attention`); the bias update's
    rate is written into the config (the checkpoint fingerprint holds model_config.json)."""
    config = build_config(model_settings({**default_config()["model"], **DEEPSEEK}), 512)
    assert config.model_type == "deepseek_v3"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.n_shared_experts, config.first_k_dense_replace) == (4, 2, 64, 1, 1)  # fmt: skip
    assert (config.n_group, config.topk_group, config.num_mtp_layers) == (1, 1, 0)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 16, 32)
    # 3 x 128 would widen a 128-wide query: projected directly
    assert (config.kv_lora_rank, config.q_lora_rank) == (128, None)
    assert config.router_bias_update_rate == 0.001
    wide = build_config(model_settings({**default_config()["model"], **DEEPSEEK, "hidden_size": 2048,
                                        "num_heads": 32, "num_kv_heads": 32, "router_bias_update_rate": 0.0}), 512)  # fmt: skip
    assert (wide.qk_nope_head_dim, wide.qk_rope_head_dim, wide.v_head_dim) == (32, 32, 64)
    assert (wide.kv_lora_rank, wide.q_lora_rank, wide.router_bias_update_rate) == (256, 768, 0.0)


def test_router_keys_on_a_continued_model_follow_its_architecture(tmp_path: Path) -> None:
    """A continued deepseek_v3 takes the bias rate (0.001 when absent) and refuses an aux loss
    coefficient; a continued Llama refuses the rate."""
    from transformers import AutoModelForCausalLM

    config = build_config(model_settings({**default_config()["model"], **DEEPSEEK}), 512)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "deepseek")
    AutoModelForCausalLM.from_config(build_config(model_settings(default_config()["model"]), 512)).save_pretrained(
        tmp_path / "llama"
    )  # fmt: skip
    model = {"init_from": str(tmp_path / "deepseek"), "architecture": None, "vocab_multiple": 64}
    assert build_config(model_settings(model), 512).router_bias_update_rate == 0.001
    rate = {**model, "router_bias_update_rate": 0.01}
    assert build_config(model_settings(rate), 512).router_bias_update_rate == 0.01
    with pytest.raises(StageError, match=r"^model\.router_aux_loss_coef: .* is a 'deepseek_v3' model, for which transformers defines no load-balancing loss"):  # fmt: skip
        build_config(model_settings({**model, "router_aux_loss_coef": 0.01}), 512)
    with pytest.raises(StageError, match=r"^model\.router_bias_update_rate: .* is a 'llama' model, whose router has no balancing bias"):  # fmt: skip
        build_config(model_settings({**rate, "init_from": str(tmp_path / "llama")}), 512)


def test_init_from_a_local_model_takes_its_shape(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = build_config(model_settings(default_config()["model"]), 512)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = {"init_from": str(tmp_path), "architecture": "llama", "vocab_multiple": 64}
    loaded = build_config(model_settings(model), 640)
    assert (loaded.hidden_size, loaded.num_hidden_layers, loaded.vocab_size) == (128, 4, 640)
    with pytest.raises(StageError, match="model.init_from: cannot load config of"):
        build_config(model_settings({**model, "init_from": str(tmp_path / "missing")}), 512)


def test_init_from_a_folder_without_weights_is_one_line(tmp_path: Path) -> None:
    """config.json alone would pass planning and fail much later, inside the training ranks."""
    build_config(model_settings(default_config()["model"]), 512).save_pretrained(tmp_path)
    model = {"init_from": str(tmp_path), "architecture": "llama", "vocab_multiple": 64}
    with pytest.raises(
        StageError, match=f"model.init_from: {tmp_path} has a config.json but no weight files"
    ) as err:
        build_config(model_settings(model), 512)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([3, 1, 1], "data.generated.level_weights: expected one weight per level 1..max_level 2, got 3"),
        ([0, 0], "data.generated.level_weights: expected at least one weight above 0, got [0, 0]"),
    ],
    ids=["one-per-level", "all-zero"],
)  # fmt: skip
def test_level_weights_that_disagree_with_max_level_fail_with_the_config(
    weights: list[float], message: str
) -> None:
    with pytest.raises(StageError) as err:
        checked({"data": {"generated": {"max_level": 2, "level_weights": weights}}})
    assert str(err.value) == f"config: {message}"


def test_a_grpo_aux_loss_on_a_model_without_one_fails_with_the_config() -> None:
    """Refused where the Snakefile validates (not after pretraining, in the GRPO ranks)."""
    with pytest.raises(StageError) as err:
        checked({"model": {"architecture": "llama"}, "grpo": {"router_aux_loss_coef": 0.01}})
    assert str(err.value) == (
        "config: grpo.router_aux_loss_coef: model.architecture llama defines no load-balancing loss "
        "(only mixtral and qwen2_moe do); expected 0"
    )
    moe = {"architecture": "mixtral", "num_experts": 4, "experts_per_token": 2}
    checked({"model": moe, "grpo": {"router_aux_loss_coef": 0.01}})


@pytest.mark.parametrize(
    ("grpo", "message"),
    [
        ({"curriculum": {"demote_below": 0.8, "promote_at": 0.7}}, "grpo.curriculum.demote_below: must be < promote_at 0.7 (got 0.8)"),
        ({"curriculum": {"start_level": 4, "max_level": 3}}, "grpo.curriculum.max_level: must be >= start_level 4 (got 3)"),
        ({"clip_eps_low": 1.0}, "grpo.clip_eps_low: expected a value < 1, got 1.0"),
        ({"steps": 80, "passes": 2, "optimizer": {"warmup_steps": 500}},
         "grpo.optimizer.warmup_steps: expected at most the stage's 160 optimizer steps (grpo.steps x grpo.passes), got 500"),
        ({"rollout": "tree", "tree": {"branching": 8}, "group_size": 4},
         "grpo.tree.branching: expected at most grpo.group_size (4), the leaves a tree is grown to, got 8"),
    ],
    ids=["demote-above-promote", "start-above-max", "clip-low-1", "grpo-warmup", "branching-above-group"],
)  # fmt: skip
def test_grpo_settings_that_keys_decide_together_fail_with_the_config(
    grpo: dict[str, Any], message: str
) -> None:
    """What the GRPO ranks refused 140 s in, after pretraining, is refused where the Snakefile
    validates the config (so `snakemake -n` says it)."""
    with pytest.raises(StageError) as err:
        checked({"grpo": grpo})
    assert str(err.value) == f"config: {message}"


@pytest.mark.parametrize(
    ("model", "parallelism", "message"),
    [
        ({}, {"ep": 2}, "ep > 1 (DeepSpeed AutoEP) splits mixtral, qwen2_moe, deepseek_v3 only, not 'llama': a dense model has no experts to split (model.architecture)"),
        (DEEPSEEK, {"ep": 2, "tp": 2}, "ep > 1 (DeepSpeed AutoEP) trains with tp 1 only (dp=None, tp=2, ep=2)"),
        (DEEPSEEK, {"ep": 2, "zero_stage": 0},
         "ep > 1 needs zero_stage 1-3 (DeepSpeed's universal converter, which reads AutoEP checkpoints, reads no ZeRO-0 one) (dp=None, tp=1, ep=2)"),
        (DEEPSEEK, {"ep": 2, "dp": 3}, "must divide dp (each group of ep data-parallel ranks shares out the experts) (dp=3, tp=1, ep=2)"),
    ],
    ids=["dense", "with-tp", "zero-0", "not-dividing-dp"],
)  # fmt: skip
def test_an_ep_that_cannot_run_fails_with_the_config(
    model: dict[str, Any], parallelism: dict[str, Any], message: str
) -> None:
    """What AutoEP would refuse inside the ranks, `snakemake -n` says first, in one line."""
    config = default_config()
    config["model"] |= model
    config["parallelism"] |= parallelism
    with pytest.raises(StageError) as err:
        checked(config)
    assert str(err.value) == f"config: parallelism.ep: {message}"
    config["model"] |= DEEPSEEK
    config["parallelism"] = {**default_config()["parallelism"], "ep": 2, "dp": 2, "zero_stage": 1}
    checked(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pretrain": {"seq_len": 512}}, "pretrain.seq_len: 512 tokens, more than model.max_position_embeddings (256)"),
        ({"grpo": {"max_new_tokens": 300}},
         "grpo.max_prompt_len + grpo.max_new_tokens: 364 tokens, more than model.max_position_embeddings (256)"),
        ({"grpo": {"curriculum": {"earlier_share": 1.0}}}, "grpo.curriculum.earlier_share: expected a value < 1, got 1.0"),
        ({"pretrain": {"steps": 50, "optimizer": {"warmup_steps": 51}}},
         "pretrain.optimizer.warmup_steps: expected at most the stage's 50 optimizer steps (pretrain.steps), got 51"),
    ],
    ids=["pretrain-seq", "grpo-seq", "earlier-share-1", "pretrain-warmup"],
)  # fmt: skip
def test_settings_that_would_truncate_or_freeze_silently_are_refused(
    changes: dict, message: str
) -> None:
    config = default_config()
    for section, values in changes.items():
        for key, value in values.items():
            config[section][key] = (
                {**config[section][key], **value} if isinstance(value, dict) else value
            )
    with pytest.raises(StageError) as err:
        checked(config)
    assert str(err.value) == f"config: {message}"


@pytest.mark.parametrize("no_replay", ["curriculum-has-all", "no-generated-source"])
def test_replay_with_nothing_to_replay_fails_the_dry_run(no_replay: str) -> None:
    """Refused with the config, not in the ranks after pretraining; naming the families keeps it."""
    config = default_config()
    config["grpo"]["replay"] = {"share": 0.25}
    if no_replay == "curriculum-has-all":
        config["grpo"]["curriculum"]["families"] = ["arithmetic", "counting", "comparison"]
    else:
        config["data"]["generated"]["weight"] = 0.0
        config["data"]["files"] = [{"path": "corpus/*.txt"}]
    with pytest.raises(
        StageError, match=r"^config: grpo.replay.share: > 0, but no family to replay"
    ):
        checked(copy.deepcopy(config))
    config["grpo"]["curriculum"]["families"] = ["comparison"]
    config["grpo"]["replay"]["families"] = ["counting"]
    checked(config)


@pytest.mark.parametrize(
    ("replay", "message"),
    [
        ({"share": 0.25, "families": ["nonsense"]}, "grpo.replay.families: unknown family 'nonsense'"),
        ({"share": 0.25, "families": ["comparison"]},
         "grpo.replay.families: 'comparison' is in grpo.curriculum.families; replay is for the others"),
    ],
    ids=["unknown", "in-curriculum"],
)  # fmt: skip
def test_replay_families_are_checked_with_the_config(replay: dict[str, Any], message: str) -> None:
    config = default_config()
    config["grpo"]["replay"] = replay
    with pytest.raises(StageError) as err:
        checked(config)
    assert str(err.value).startswith(f"config: {message}")


@pytest.mark.parametrize(
    ("config", "expected"),
    [("GPT2Config", "is a 'gpt2' model whose config.json has no intermediate_size"),
     ("T5Config", "is a 't5' model, not a decoder-only causal LM")],
)  # fmt: skip
def test_init_from_a_model_the_planner_cannot_count_is_one_line(
    tmp_path: Path, config: str, expected: str
) -> None:
    """Both crashed the planner with a traceback; the line says what it trains."""
    import transformers

    getattr(transformers, config)().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    model = {"init_from": str(tmp_path), "architecture": None, "vocab_multiple": 64}
    with pytest.raises(StageError) as err:
        build_config(model_settings(model), 512)
    assert str(err.value).startswith(
        f"model.init_from: {str(tmp_path)!r} {expected}; stagetrain trains Llama-style decoders"
    )


def test_an_ep_refusal_says_only_what_is_known_of_the_architecture() -> None:
    """Every MoE architecture of the config's splits; an init_from folder's other model_type is
    refused without a claim about DeepSpeed's presets (qwen3_moe has one, unchecked here)."""
    from stagetrain.model.architectures import EXPERT_PARALLEL, expert_parallel_refusal

    assert all(expert_parallel_refusal(a) is None for a in EXPERT_PARALLEL)
    assert "a dense model has no experts to split" in expert_parallel_refusal("llama")
    assert expert_parallel_refusal("qwen3_moe").endswith(
        "not 'qwen3_moe': not an architecture checked with AutoEP here (tools/autoep_probe.py)"
    )


@pytest.mark.parametrize("path", ["../secrets.jsonl", "data/../../x.jsonl", "/etc/x.jsonl", "data\\x.jsonl",
                                  "data//x.jsonl", "./x.jsonl", ""])  # fmt: skip
@pytest.mark.parametrize("where", ["tasks", "data"])
def test_a_hub_file_outside_its_repo_fails_the_dry_run_in_one_line(path: str, where: str) -> None:
    """'..' and absolute paths reached huggingface_hub as a traceback; they are refused with
    the config, naming the key, for task files and corpus files alike."""

    def config(file: str) -> dict[str, Any]:
        if where == "tasks":
            return {
                "tasks": {
                    "families": [{"name": "mine", "files": [{"repo": "org/tasks", "file": file}]}]
                }
            }
        return {"data": {"hub": [{"repo": "org/corpus", "files": ["data/a.jsonl", file]}]}}

    checked(config("data/sub/x.jsonl"))
    key = "tasks.families.0.files.0.file" if where == "tasks" else "data.hub.0.files.1"
    with pytest.raises(StageError) as err:
        checked(config(path))
    assert str(err.value) == (f"config: {key}: {path!r} is not a file of the repo (expected a relative path "
                              "like data/train.jsonl, without '.', '..' or empty parts)")  # fmt: skip


KEYWORDS = {"$schema", "$defs", "$ref", "title", "description", "type", "enum", "const", "default", "properties",
            "additionalProperties", "required", "items", "minItems", "maxItems", "uniqueItems", "minimum", "maximum",
            "exclusiveMinimum", "exclusiveMaximum", "pattern", "minLength", "maxLength", "oneOf", "anyOf", "allOf",
            "not", "if", "then", "else", "propertyNames", "minProperties", "maxProperties", "examples"}  # fmt: skip


def test_every_schema_description_is_one_string_and_every_key_a_keyword() -> None:
    """In a YAML flow mapping, `description: a, b: c` is a description "a" and a stray key "b";
    such a key is no JSON Schema keyword, and the schema would silently not say what it meant."""
    found: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{where}[{i}]")
            return
        if not isinstance(node, dict):
            return
        found.extend(f"{where}.{k}: not a JSON Schema keyword" for k in node if k not in KEYWORDS)
        if "description" in node and not isinstance(node["description"], str):
            found.append(f"{where}.description: {node['description']!r} is not one string")
        for key, value in node.items():
            if key in ("properties", "$defs"):
                for name, sub in value.items():
                    walk(sub, f"{where}.{name}")
            elif key in (
                "items",
                "oneOf",
                "anyOf",
                "allOf",
                "not",
                "additionalProperties",
                "if",
                "then",
                "else",
            ):
                walk(value, f"{where}.{key}")

    walk(yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text()), "schema")
    assert not found, found
