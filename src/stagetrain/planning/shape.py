"""Exact parameter counts of the model to train, from its transformers config.

Building a 70B model on the meta device takes about a second, too slow for a
planner asked to answer in under one. Decoder layers of the architectures here
are identical, so the model is built on the meta device with one and with two
layers, and the count is extrapolated exactly: total = P(1) + (L - 1) * (P(2) - P(1)).
Configs with per-layer differences (deepseek_v3's leading dense layers) are built whole.

The memory model's shape facts are a Llama block's; for the others, what they stand for:
- `intermediate_size` is the MLP width one token passes through (its routed experts and
  any shared expert), averaged over the layers where dense and MoE layers differ: the
  activations are linear in it, so their sum over the layers is exact.
- `head_dim` is a query/key head's width (deepseek_v3's latent attention: the unrotated
  and rotary parts together), and `kv_cache_width` the elements one token adds to one
  layer's KV cache: keys and values, 2 x kv_heads x head_dim; under latent attention the
  compressed latent and the shared rotary key, kv_lora_rank + qk_rope_head_dim, which is
  what transformers' cache holds for it.

Importing torch and transformers to count costs seconds, and the planner runs in Snakemake's own
process whenever an edit it reads changes (planning/ahead.py), so a dry run after a learning-rate
or batch edit paid them although the model had not changed. A shape depends only on the model
section, the vocabulary and the code that counts it, so it is kept on disk by a digest of those
(`shape_key`, `cached_shape`) and the imports happen only when the model itself changes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stagetrain.config.settings import ModelSettings
from stagetrain.io import kept_json

if TYPE_CHECKING:
    from transformers import PretrainedConfig

COUNTING_CODE = (
    Path(__file__),
    *(Path(__file__).parents[1] / "model" / name for name in ("config.py", "architectures.py")),
)
"""The modules a shape is worked out by: a change to any is a new cache key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the memory and throughput models need to know about a model."""

    params: int
    """All parameters."""
    active_params: int
    """Parameters a token passes through (MoE: only its routed experts)."""
    layer_params: int
    """Parameters of one decoder layer."""
    embedding_params: int
    """Input embedding plus an untied output projection: the parts AutoTP does not shard."""
    largest_module_params: int
    """Largest parameter count held directly by one module (DeepSpeed's 'largest layer')."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Width of the MLP a token passes through (for MoE: its experts_per_token routed experts
    plus any shared expert), averaged over the layers where they differ."""
    experts_per_token: int
    num_experts: int
    """Routed experts per MoE layer (0: a dense model)."""
    expert_params: int
    """Parameters of every MoE layer's routed experts, all layers: what ep splits."""
    moe_layers: int
    """Layers whose MLP is routed experts (their tokens cross ranks twice each way under ep)."""
    model_type: str
    """transformers' model_type (the architecture), which says whether AutoEP has a preset."""
    vocab_size: int
    kv_cache_width: int
    """Elements one token adds to one layer's KV cache (2 x kv_heads x head_dim; latent
    attention: kv_lora_rank + qk_rope_head_dim)."""


def _homogeneous(config: PretrainedConfig) -> bool:
    return (
        not getattr(config, "mlp_only_layers", None)
        and getattr(config, "decoder_sparse_step", 1) == 1
        and not getattr(config, "first_k_dense_replace", 0)
        and len(set(getattr(config, "layer_types", None) or ())) <= 1
    )


def _counts(config: PretrainedConfig, layers: int) -> dict[str, int]:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel()
        for name, p in model.named_parameters()
        if ".experts." in name or name.endswith(".experts")
    )
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    untied = head is not None and head.weight is not model.get_input_embeddings().weight
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {
        "total": total,
        "experts": experts,
        "moe_layers": sum(name.endswith(".experts") for name, _ in model.named_modules()),
        "embedding": embed + (head.weight.numel() if untied else 0),
        "largest": largest,
    }


def model_shape(config: PretrainedConfig) -> ModelShape:
    """Count the parameters of `config` exactly (meta device, no memory allocated)."""
    layers = config.num_hidden_layers
    if _homogeneous(config) and layers > 2:
        one, two = _counts(config, 1), _counts(config, 2)
        per_layer = {k: two[k] - one[k] for k in one}
        full = {k: one[k] + (layers - 1) * per_layer[k] for k in one}
        full["largest"] = max(one["largest"], two["largest"])
        full["embedding"] = one["embedding"]
    else:
        full = _counts(config, layers)
        per_layer = {"total": (full["total"] - full["embedding"]) // layers}
    num_experts = (
        getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    )
    top_k = getattr(config, "num_experts_per_tok", 1) if num_experts else 1
    inactive = full["experts"] * (num_experts - top_k) // num_experts if num_experts else 0
    heads = config.num_attention_heads
    head_dim = (
        getattr(config, "qk_head_dim", None)
        or getattr(config, "head_dim", None)
        or config.hidden_size // heads
    )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    latent = getattr(config, "kv_lora_rank", None)
    return ModelShape(
        params=full["total"],
        active_params=full["total"] - inactive,
        layer_params=per_layer["total"],
        embedding_params=full["embedding"],
        largest_module_params=full["largest"],
        num_layers=layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=mlp_width(config, top_k if num_experts else 0),
        experts_per_token=top_k,
        num_experts=num_experts,
        expert_params=full["experts"],
        moe_layers=full["moe_layers"],
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        kv_cache_width=latent + config.qk_rope_head_dim if latent else 2 * kv_heads * head_dim,
    )


def mlp_width(config: PretrainedConfig, top_k: int) -> int:
    """The MLP width a token passes through, averaged over the layers (`ModelShape.intermediate_size`):
    a dense model's intermediate_size; an MoE layer's top_k routed experts plus its shared
    expert (qwen2_moe: shared_expert_intermediate_size; deepseek_v3: n_shared_experts of
    moe_intermediate_size); deepseek_v3's first_k_dense_replace layers the dense width."""
    if not top_k:
        return config.intermediate_size
    expert = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or (
        getattr(config, "n_shared_experts", 0) * expert
    )
    layers, dense = config.num_hidden_layers, getattr(config, "first_k_dense_replace", 0) or 0
    moe = top_k * expert + shared
    return (dense * config.intermediate_size + (layers - dense) * moe) // layers


def shape_key(model: ModelSettings, vocab_size: int, tp: int) -> str | None:
    """A digest of everything `model`'s shape at `tp` follows from: the model section, the
    tokenizer's vocabulary, a local start model's config.json, transformers' version and the
    counting code. None for a start model on a hub, whose config is downloaded to be read."""
    start = None
    if model.init_from:
        config_json = Path(model.init_from) / "config.json"
        if not config_json.is_file():
            return None
        start = hashlib.sha256(config_json.read_bytes()).hexdigest()
    record = {
        "model": asdict(model),
        "vocab_size": vocab_size,
        "tp": tp,
        "config.json": start,
        "transformers": importlib.metadata.version("transformers"),
        "code": [hashlib.sha256(p.read_bytes()).hexdigest() for p in COUNTING_CODE],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def cached_shape(folder: Path, key: str | None, count: Callable[[], ModelShape]) -> ModelShape:
    """The shape kept in `folder` under `key`, else `count()`, kept there for the next run."""
    if key is None:
        return count()
    return kept_json(folder / f"{key}.json", count, lambda kept: ModelShape(**kept), asdict)
