"""DeepSpeed AutoEP's names for an MoE layer's weights, against transformers' names.

Under expert parallelism (ep > 1) AutoEP replaces each `model.layers.N.mlp` with its own layer
(`AutoEPMoELayer`), and its weights take AutoEP's names:

- the router's weight and routing bias move under `router.` (`gate.weight` ->
  `router.gate.weight`, `gate.e_score_correction_bias` -> `router.e_score_correction_bias`);
- the routed experts' fused gate-and-up projection, (experts, 2 x width, hidden) in
  transformers, is split in two along its middle dimension, the gate half first (`w1`) and the
  up half (`w3`); the down projection keeps its shape as `w2`.

- a shared expert is `shared_experts.` and its gate `shared_experts_gate.` whatever the model
  called them: DeepSeek's ungated `shared_experts.` keeps its name, qwen2_moe's gated
  `shared_expert.` and `shared_expert_gate.` gain an s (`gated_shared_expert`).

A checkpoint written under AutoEP holds these names. A resume that turns AutoEP on or off, and
consolidation, which writes transformers' names, rename DeepSpeed's universal copy of it
(`training.reshard`). Checked against transformers 5.25's DeepseekV3 and
DeepSpeed 0.19.8 (AutoEP's `ep_repack` splits `gate_up_proj` this way); the mapping is kept here
alone so that a change to either side is mended in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

RENAMED = {
    "router.gate.weight": "gate.weight",
    "router.e_score_correction_bias": "gate.e_score_correction_bias",
    "experts.w2": "experts.down_proj",
}
"""AutoEP's name within an MoE layer -> transformers' name, for the tensors kept whole."""
AUTOEP_OF = {hf: autoep for autoep, hf in RENAMED.items()}
GATE, UP, FUSED = "experts.w1", "experts.w3", "experts.gate_up_proj"
"""AutoEP's gate and up halves of transformers' fused projection."""
ROUTER, CHOSEN = "TokenChoiceTopKRouter", 1
"""The router of DeepSpeed AutoEP's MoE layer, matched by name so that nothing here imports
DeepSpeed; its forward returns (gate weights, chosen experts, tokens per expert), at CHOSEN
the experts as global ids, one row per token of the layer's input in (sequence, position)
order."""


def routers(model: Any) -> list[Any]:
    """The routers of the MoE layers AutoEP replaced in `model`, in module order; none for a
    model without expert parallelism."""
    return [m for m in model.modules() if type(m).__name__ == ROUTER]


def _layer(name: str, suffixes: Iterable[str]) -> tuple[str, str] | None:
    """('model.layers.3.mlp.', suffix) for a name of an MoE layer ending in one of `suffixes`."""
    for suffix in suffixes:
        if name.endswith(f".mlp.{suffix}"):
            return name[: -len(suffix)], suffix
    return None


SHARED = {
    ".mlp.shared_experts.": ".mlp.shared_expert.",
    ".mlp.shared_experts_gate.": ".mlp.shared_expert_gate.",
}
"""AutoEP's names of a gated shared expert and its gate -> qwen2_moe's (transformers')."""


def gated_shared_expert(names: Iterable[str]) -> bool:
    """Whether the MoE layers that `names` (a checkpoint's, either side's) come from gate a
    shared expert, as qwen2_moe's do: only then is AutoEP's `shared_experts.` transformers'
    `shared_expert.` (DeepSeek's shared experts, ungated, have AutoEP's name already)."""
    gates = tuple(f"{g}weight" for g in (*SHARED, *SHARED.values()) if "gate" in g)
    return any(name.endswith(gates) for name in names)


def transformers_name(name: str, gated_shared: bool) -> str:
    """transformers' name for AutoEP's `name` (both halves: the fused projection); any other
    name is its own. `gated_shared`: the model's shared expert is gated (`gated_shared_expert`)."""
    if gated_shared:
        for autoep, hf in SHARED.items():
            if autoep in name:
                return name.replace(autoep, hf)
    found = _layer(name, (*RENAMED, GATE, UP))
    if found is None:
        return name
    layer, suffix = found
    return layer + RENAMED.get(suffix, FUSED)


def autoep_names(name: str) -> tuple[str, ...]:
    """AutoEP's names for transformers' `name`: the (gate, up) halves of the fused projection,
    the renamed tensor's one name, or `name` itself."""
    for autoep, hf in SHARED.items():
        if hf in name:
            return (name.replace(hf, autoep),)
    found = _layer(name, (*RENAMED.values(), FUSED))
    if found is None:
        return (name,)
    layer, suffix = found
    if suffix == FUSED:
        return layer + GATE, layer + UP
    return (layer + AUTOEP_OF[suffix],)


class _KeyedRegistry(dict[Any, Any]):
    """transformers' output-capture registry, readable both ways: by class name, as DeepSpeed
    0.19.8's AutoEP reads (and writes) it, and by model, as transformers >= 5.23 reads it."""

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, str):
            return super().get(key, default)
        return super().get(str(key.__class__)) or {}


@contextlib.contextmanager
def keyed_output_registry() -> Iterator[None]:
    """transformers' output-capture registry, lent to AutoEP in a form it can edit.

    Where a model records its router logits (Mixtral's load-balancing loss reads them), AutoEP
    points the record at its own router by editing `transformers.utils.output_capturing.
    _CAN_RECORD_REGISTRY` by class name, then has transformers install its hooks from it.
    transformers 5.23 made the registry's `get` take a model instead of a name, so DeepSpeed
    0.19.8's call fails (Mixtral's preset). Around `deepspeed.initialize` the module holds a
    registry of the same entries that answers both. AutoEP installs the model's hooks from it
    and restores the entries it changed, so the original goes back as it was. Nothing to do
    where the registry is a plain dict (transformers 5.17, the GPU check's).
    """
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    if type(registry) is dict:
        yield
        return
    output_capturing._CAN_RECORD_REGISTRY = _KeyedRegistry(registry)
    try:
        yield
    finally:
        output_capturing._CAN_RECORD_REGISTRY = registry
