"""The pretrain stage: one DeepSpeed engine over torchrun ranks, trained on the token shards.

Modules: `train` (the loop; the torchrun entry point), `metrics` (its registry
of metric names and the record's type), `summary` (summary.json's type), `plot`
(the loss figure). The runtime it runs on (launch, engine, checkpoints, data
order, evaluation) is stagetrain.training.
"""
