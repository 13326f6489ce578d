"""What the `model` section's architectures differ in, as plain data.

Kept apart from `model.config` (which imports transformers, and with it torch) because the
config checks that every DAG build runs read it: a `snakemake -n` must not pay torch's import.
"""

from __future__ import annotations

MOE_KEYS = {
    "llama": (),
    "mixtral": ("num_experts", "experts_per_token"),
    "qwen2_moe": ("num_experts", "experts_per_token", "moe_intermediate_size"),
    "deepseek_v3": ("num_experts", "experts_per_token", "moe_intermediate_size",
                    "num_shared_experts", "first_dense_layers"),
}  # fmt: skip
"""The MoE keys each architecture reads (llama: none)."""
ALL_MOE_KEYS = ("num_experts", "experts_per_token", "moe_intermediate_size", "num_shared_experts",
                "first_dense_layers")  # fmt: skip
ARCHITECTURES = tuple(MOE_KEYS)
AUX_LOSS = ("mixtral", "qwen2_moe")
"""The architectures whose transformers class defines a load-balancing loss (`router_aux_loss_coef`)."""
BIAS_BALANCED = ("deepseek_v3",)
"""The architectures balanced by a routing bias instead (`router_bias_update_rate`)."""
ROUTER_BIAS_UPDATE_RATE = 1e-3
"""DeepSeek-V3's bias update speed for most of its pretraining: the default of
`model.router_bias_update_rate`."""
EXPERT_PARALLEL = ("mixtral", "qwen2_moe", "deepseek_v3")
"""The architectures `parallelism.ep` > 1 splits: DeepSpeed AutoEP has a preset for each (qwen2_moe
takes qwen3_moe's, found from its model_type, its gated shared expert kept whole on every rank).
Mixtral's and Qwen's presets need `training.autoep.keyed_output_registry` with transformers >= 5.23
(`python tools/autoep_probe.py` checks all three)."""


def expert_parallel_refusal(architecture: str) -> str | None:
    """Why `parallelism.ep` > 1 cannot split `architecture` (transformers' model_type); None if it can."""
    if architecture in EXPERT_PARALLEL:
        return None
    why = (  # an init_from folder's model_type may be any: say only what is known of it
        "a dense model has no experts to split"
        if MOE_KEYS.get(architecture) == ()
        else "not an architecture checked with AutoEP here (tools/autoep_probe.py)"
    )
    return f"ep > 1 (DeepSpeed AutoEP) splits {', '.join(EXPERT_PARALLEL)} only, not {architecture!r}: {why}"
