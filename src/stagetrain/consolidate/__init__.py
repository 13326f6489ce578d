"""The consolidate stage: a training stage's sharded DeepSpeed checkpoint as a verified Hugging Face folder.

Modules: `weights` (find and check the checkpoint's files, and where each weight
lies in them: ZeRO 1-3 fp32 partitions, ZeRO 0 and AutoTP model files),
`stored` (file regions, read a bounded chunk at a time with pread), `writer`
(safetensors shards streamed from those chunks, with the standard index),
`folder` (the stage: config, generation config, tokenizer, weights,
verification, manifest, written under a temporary name and renamed).
"""
