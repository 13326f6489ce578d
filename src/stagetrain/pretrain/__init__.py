"""The pretrain stage: one DeepSpeed engine over torchrun ranks, trained on the token shards.

Modules: `launch` (the torchrun / srun command, process lifetime), `batches`
(which samples each data-parallel rank reads at each step), `checkpoints`
(fingerprinted, resumable, atomic pointer), `lock` (one writer per stage's
checkpoint folder), `metrics` (registry, MFU, progress), `engine` (model and
engine construction), `train` (the loop; the torchrun entry point).
"""
