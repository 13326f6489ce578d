"""The transformers config of the model to train, built from the `model` config section.

Shared by the planner (which counts parameters from it) and the tokenizer stage
(which writes it as model_config.json with the padded vocabulary), so both see
the same architecture.

The DeepSeek-style MoE is transformers' `deepseek_v3`, not `deepseek_v2`: V3's router holds
the routing bias (`e_score_correction_bias`, added to the sigmoid scores for the choice of
experts only) that its auxiliary-loss-free balancing trains (`training.experts`), and V2's has
none. Neither class has DeepSeek's "MoE every other layer" option; both have
`first_k_dense_replace`, leading dense layers (`model.first_dense_layers`), which is what the
DeepSeek preset uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import (
    AutoConfig,
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from stagetrain.config.settings import ModelSettings
from stagetrain.errors import StageError
from stagetrain.model.architectures import (
    ALL_MOE_KEYS,
    ARCHITECTURES,
    AUX_LOSS,
    BIAS_BALANCED,
    MOE_KEYS,
    ROUTER_BIAS_UPDATE_RATE,
)

SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "max_position_embeddings", "rope_theta", "tie_word_embeddings",
)  # fmt: skip
DECODER_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
)  # fmt: skip
SUPPORTED = (
    "llama, mistral, qwen2, mixtral, qwen2_moe, deepseek_v3 and others with the same config fields"
)


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
            f"model.architecture: required for a from-scratch model ({', '.join(ARCHITECTURES)})"
        )
    needed = SHAPE_KEYS + MOE_KEYS[arch]
    missing = [k for k in needed if getattr(model, k) is None]
    if missing:
        raise StageError(
            f"model.{missing[0]}: required for a from-scratch {arch} model "
            f"(expected all of: {', '.join(needed)})"
        )
    stray = [k for k in ALL_MOE_KEYS if getattr(model, k) is not None and k not in MOE_KEYS[arch]]
    if arch == "deepseek_v3" and model.router_aux_loss_coef is not None:
        raise StageError(
            "model.router_aux_loss_coef: transformers defines no load-balancing loss for deepseek_v3 "
            "(its router is balanced by a bias: model.router_bias_update_rate); remove it"
        )
    if arch not in AUX_LOSS and model.router_aux_loss_coef is not None:
        stray.append("router_aux_loss_coef")
    if arch not in BIAS_BALANCED and model.router_bias_update_rate is not None:
        stray.append("router_bias_update_rate")
    if stray:
        raise StageError(f"model.{stray[0]}: not used by architecture {arch!r}; remove it")
    heads, kv_heads, hidden = model.num_heads, model.num_kv_heads, model.hidden_size
    assert heads is not None and kv_heads is not None and hidden is not None  # in SHAPE_KEYS
    if hidden % heads:
        raise StageError(f"model.num_heads: {heads} must divide model.hidden_size {hidden}")
    if heads % kv_heads:
        raise StageError(f"model.num_kv_heads: {kv_heads} must divide model.num_heads {heads}")
    if model.experts_per_token is not None and model.experts_per_token > (model.num_experts or 0):
        raise StageError(
            f"model.experts_per_token: {model.experts_per_token} exceeds "
            f"model.num_experts {model.num_experts}"
        )
    if arch == "deepseek_v3":
        _check_deepseek(model)
    return arch


def _check_deepseek(model: ModelSettings) -> None:
    """What deepseek_v3's latent attention and leading dense layers need of the shape keys."""
    heads, hidden = model.num_heads, model.hidden_size
    layers, dense = model.num_layers, model.first_dense_layers  # required: `_check_shape`
    assert heads is not None and hidden is not None and layers is not None and dense is not None
    if model.num_kv_heads != heads:
        raise StageError(
            f"model.num_kv_heads: deepseek_v3's latent attention has one key and value per query "
            f"head: expected model.num_heads ({heads}), got {model.num_kv_heads}"
        )
    if (hidden // heads) % 4:
        raise StageError(
            f"model.num_heads: deepseek_v3 gives half of each head's hidden_size / num_heads = "
            f"{hidden // heads} dimensions to the rotary embedding, in pairs: it must be a multiple of 4"
        )
    if dense >= layers:
        raise StageError(
            f"model.first_dense_layers: {model.first_dense_layers} leaves no MoE layer of "
            f"model.num_layers {model.num_layers}"
        )


def latent_attention(hidden_size: int, num_heads: int) -> dict[str, int | None]:
    """deepseek_v3's multi-head latent attention dimensions, from head_dim = hidden / heads.

    DeepSeek-V3's own proportions (query/key heads of 128 unrotated and 64 rotary
    dimensions, values of 128, a key-value latent of 512 = 4 x 128, a query latent of
    1536 = 3 x 512), scaled so that a query/key head and a value head are each head_dim
    wide, as in the Llama of the same width and heads: half of each query/key head is
    rotary, half not; values are head_dim; the key-value latent is 4 x head_dim. The
    attention then does the FLOPs the planner's 12 L h s counts for it, and its output
    projection is a Llama's. The query latent is 3 x the key-value latent where that
    compresses the query (below hidden_size); otherwise the query is projected directly
    (`q_lora_rank` None), as DeepSeek-V2-Lite does, since a low-rank step wider than the
    residual stream only adds parameters. Derived, not config keys: one rule keeps the
    shape keys those of every other architecture.
    """
    head_dim = hidden_size // num_heads
    kv_rank = 4 * head_dim
    return {
        "qk_rope_head_dim": head_dim // 2,
        "qk_nope_head_dim": head_dim - head_dim // 2,
        "v_head_dim": head_dim,
        "kv_lora_rank": kv_rank,
        "q_lora_rank": 3 * kv_rank if 3 * kv_rank < hidden_size else None,
    }


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
    assert heads is not None and hidden is not None and model.rope_theta is not None  # checked
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
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            **common,
            **latent_attention(hidden, heads),
            n_routed_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
            moe_intermediate_size=model.moe_intermediate_size,
            n_shared_experts=model.num_shared_experts,
            first_k_dense_replace=model.first_dense_layers,
            n_group=1,  # no device-limited routing: every expert is one group's
            topk_group=1,
            routed_scaling_factor=1.0,  # the router's weights as they are (V3's 2.5 is for 256 experts)
            num_mtp_layers=0,  # no multi-token prediction module is trained
            router_bias_update_rate=(
                ROUTER_BIAS_UPDATE_RATE
                if model.router_bias_update_rate is None
                else model.router_bias_update_rate
            ),
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
    assert model.init_from is not None  # build_config's branch
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
        if config.model_type in BIAS_BALANCED:
            raise StageError(
                f"model.router_aux_loss_coef: {model.init_from!r} is a {config.model_type!r} model, "
                "for which transformers defines no load-balancing loss (its router is balanced by a "
                "bias: model.router_bias_update_rate); remove it"
            )
        if not hasattr(config, "router_aux_loss_coef"):
            raise StageError(
                f"model.router_aux_loss_coef: {model.init_from!r} is a {config.model_type!r} model "
                "without a router (the coefficient is for mixture-of-experts models); remove it"
            )
        config.router_aux_loss_coef = model.router_aux_loss_coef
    if config.model_type in BIAS_BALANCED:
        rate = model.router_bias_update_rate
        config.router_bias_update_rate = ROUTER_BIAS_UPDATE_RATE if rate is None else rate
    elif model.router_bias_update_rate is not None:
        raise StageError(
            f"model.router_bias_update_rate: {model.init_from!r} is a {config.model_type!r} model, "
            f"whose router has no balancing bias ({', '.join(BIAS_BALANCED)} only); remove it"
        )
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
    special_ids: Mapping[str, object],
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
