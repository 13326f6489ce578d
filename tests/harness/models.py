"""Random tiny models for the rollout tests (a Llama, and two MoE architectures): seeded, in
eval mode, with logits sharp enough (initializer_range 0.5) that sampled and greedy paths differ
and branch."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)


def tiny_llama() -> LlamaForCausalLM:
    """2 layers, 32 wide, a 64-token vocabulary; the same weights on every call."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_moe(architecture: str) -> PreTrainedModel:
    """tiny_llama's shape as a Mixtral, a Qwen2-MoE or a DeepSeek-V3 (four experts, top two;
    DeepSeek's first layer MoE too, its routing bias random so that it moves the choice); seeded,
    in eval mode."""
    torch.manual_seed(0)
    common = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 128, "initializer_range": 0.5, "num_experts_per_tok": 2}  # fmt: skip
    if architecture == "mixtral":
        config = MixtralConfig(
            **common, intermediate_size=64, num_key_value_heads=2, num_local_experts=4
        )
        return MixtralForCausalLM(config).eval()
    if architecture == "qwen2_moe":  # every layer MoE, with its gated shared expert
        config = Qwen2MoeConfig(**common, intermediate_size=64, num_key_value_heads=2, num_experts=4,
                                moe_intermediate_size=32, shared_expert_intermediate_size=64)  # fmt: skip
        return Qwen2MoeForCausalLM(config).eval()
    config = DeepseekV3Config(**common, intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=4,
                              n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0,
                              q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=8)  # fmt: skip
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)
    return model
