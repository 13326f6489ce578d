"""A random tiny Llama for the rollout tests: seeded, in eval mode, with logits sharp enough
(initializer_range 0.5) that sampled and greedy paths differ and branch."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama() -> LlamaForCausalLM:
    """2 layers, 32 wide, a 64-token vocabulary; the same weights on every call."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5)  # fmt: skip
    return LlamaForCausalLM(config).eval()
