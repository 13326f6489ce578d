"""The transformers config of the model to train, built from the `model` config section.

Shared by the planner (which counts parameters from it) and the tokenizer stage
(which writes it as model_config.json with the padded vocabulary), so both see
the same architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import AutoConfig, LlamaConfig, MixtralConfig, PretrainedConfig, Qwen2MoeConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from stagetrain.config.settings import ModelSettings
from stagetrain.errors import StageError

SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "max_position_embeddings", "rope_theta", "tie_word_embeddings",
)  # fmt: skip
MOE_KEYS = {
    "llama": (),
    "mixtral": ("num_experts", "experts_per_token"),
    "qwen2_moe": ("num_experts", "experts_per_token", "moe_intermediate_size"),
}
ALL_MOE_KEYS = ("num_experts", "experts_per_token", "moe_intermediate_size")
DECODER_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
)  # fmt: skip
SUPPORTED = "llama, mistral, qwen2, mixtral, qwen2_moe and others with the same config fields"


def padded_vocab(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def _check_shape(model: ModelSettings) -> str:
    """The architecture of a from-scratch `model`, after checking its shape keys.

    Raises:
        StageError: a shape key that is missing, not allowed, or inconsistent.
    """
    arch = model.architecture
    if arch is None:
        raise StageError(
            "model.architecture: required for a from-scratch model (llama, mixtral, qwen2_moe)"
        )
    needed = SHAPE_KEYS + MOE_KEYS[arch]
    missing = [k for k in needed if getattr(model, k) is None]
    if missing:
        raise StageError(
            f"model.{missing[0]}: required for a from-scratch {arch} model "
            f"(expected all of: {', '.join(needed)})"
        )
    stray = [k for k in ALL_MOE_KEYS if getattr(model, k) is not None and k not in MOE_KEYS[arch]]
    if arch == "llama" and model.router_aux_loss_coef is not None:
        stray.append("router_aux_loss_coef")
    if stray:
        raise StageError(f"model.{stray[0]}: not used by architecture {arch!r}; remove it")
    heads, kv_heads, hidden = model.num_heads, model.num_kv_heads, model.hidden_size
    if hidden % heads:
        raise StageError(f"model.num_heads: {heads} must divide model.hidden_size {hidden}")
    if heads % kv_heads:
        raise StageError(f"model.num_kv_heads: {kv_heads} must divide model.num_heads {heads}")
    if model.experts_per_token is not None and model.experts_per_token > (model.num_experts or 0):
        raise StageError(
            f"model.experts_per_token: {model.experts_per_token} exceeds "
            f"model.num_experts {model.num_experts}"
        )
    return arch


def build_config(model: ModelSettings, vocab_size: int) -> PretrainedConfig:
    """The transformers config for `model` (a validated config section).

    Args:
        model: the `model` section.
        vocab_size: embedding rows (already padded) for a from-scratch model;
            a continued model keeps its own unless this is larger.

    Raises:
        StageError: a shape key that is missing, not allowed, or inconsistent.
    """
    if model.init_from:
        return _load_pretrained(model, vocab_size)
    arch = _check_shape(model)
    heads, kv_heads, hidden = model.num_heads, model.num_kv_heads, model.hidden_size
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=model.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta)},
        tie_word_embeddings=model.tie_word_embeddings,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    coef = (
        {}
        if model.router_aux_loss_coef is None
        else {"router_aux_loss_coef": model.router_aux_loss_coef}
    )
    if arch == "mixtral":
        return MixtralConfig(
            **common,
            **coef,
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
        )
    return Qwen2MoeConfig(
        **common,
        **coef,
        num_experts=model.num_experts,
        num_experts_per_tok=model.experts_per_token,
        moe_intermediate_size=model.moe_intermediate_size,
        shared_expert_intermediate_size=model.intermediate_size,
    )


def _load_pretrained(model: ModelSettings, vocab_size: int) -> PretrainedConfig:
    given = [k for k in SHAPE_KEYS + ALL_MOE_KEYS if getattr(model, k) is not None]
    if given:
        raise StageError(
            f"model.{given[0]}: not allowed with model.init_from "
            "(the shape comes from that model's config.json)"
        )
    try:
        config = AutoConfig.from_pretrained(model.init_from, trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0]
        raise StageError(
            f"model.init_from: cannot load config of {model.init_from!r}: {first}"
        ) from None
    folder = Path(model.init_from)
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise StageError(
            f"model.init_from: {folder} has a config.json but no weight files (*.safetensors or *.bin)"
        )
    _check_decoder(config, model.init_from)
    if model.architecture and config.model_type != model.architecture:
        raise StageError(
            f"model.architecture: {model.architecture!r} but {model.init_from!r} is a "
            f"{config.model_type!r} model"
        )
    if model.router_aux_loss_coef is not None:
        if not hasattr(config, "router_aux_loss_coef"):
            raise StageError(
                f"model.router_aux_loss_coef: {model.init_from!r} is a {config.model_type!r} model "
                "without a router (the coefficient is for mixture-of-experts models); remove it"
            )
        config.router_aux_loss_coef = model.router_aux_loss_coef
    config.vocab_size = max(config.vocab_size, vocab_size)
    return config


def _check_decoder(config: PretrainedConfig, source: str) -> None:
    """A continued model must be a decoder-only causal LM with the Llama family's config fields,
    which the planner counts from and the engine resizes: GPT-2 names them differently (n_inner,
    often None) and T5 is an encoder-decoder, and both crashed the planner with a traceback."""
    kind = config.model_type
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise StageError(
            f"model.init_from: {source!r} is a {kind!r} model, not a decoder-only causal LM; "
            f"stagetrain trains Llama-style decoders ({SUPPORTED})"
        )
    missing = [k for k in DECODER_FIELDS if getattr(config, k, None) is None]
    if missing:
        raise StageError(
            f"model.init_from: {source!r} is a {kind!r} model whose config.json has no {missing[0]}; "
            f"stagetrain trains Llama-style decoders ({SUPPORTED})"
        )


def training_config(
    model: ModelSettings,
    *,
    tokenizer_size: int,
    special_ids: Mapping[str, int | None],
    tp: int,
) -> PretrainedConfig:
    """The config of the model to train: the tokenizer's vocabulary padded to vocab_multiple * tp.

    A continued model keeps its rows and grows to the padded size; when it may
    not grow (model.resize_embeddings false) a larger tokenizer is an error and
    the model's own size is kept.

    Raises:
        StageError: the tokenizer does not fit and resizing is not allowed.
    """
    multiple = model.vocab_multiple
    if not model.init_from:
        config = build_config(model, padded_vocab(tokenizer_size, multiple, tp))
    else:
        config = build_config(model, 0)  # the continued model's own vocabulary
        original = config.vocab_size
        if not model.resize_embeddings:
            if tokenizer_size > original:
                raise StageError(
                    f"model.resize_embeddings: false, but the tokenizer has {tokenizer_size} tokens "
                    f"and {model.init_from!r} only {original} embedding rows"
                )
        else:
            config.vocab_size = padded_vocab(max(original, tokenizer_size), multiple, tp)
    for key, value in special_ids.items():
        setattr(config, key, value)
    return config
