"""The consolidate stage: a training stage's sharded DeepSpeed checkpoint as a verified Hugging Face folder.

Modules: `weights` (find and check the checkpoint's files, read the weights:
ZeRO 1-3 through DeepSpeed's zero_to_fp32 in lazy mode, ZeRO 0 and AutoTP from
the model files), `writer` (sharded safetensors with the standard index),
`folder` (the stage: config, generation config, tokenizer, weights, verification,
manifest, written under a temporary name and renamed).
"""
