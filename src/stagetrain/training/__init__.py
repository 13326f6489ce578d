"""The training runtime both training stages (and consolidation) share.

Modules: `deepspeed_config` (the render_deepspeed_config stage: the DeepSpeed config each
training stage's engine is built with), `launch` (the launcher side: the job spec, the torchrun / srun
command, running the ranks), `spec` (the job spec's types), `rank` (every rank's entry and the death signals),
`engine` (joining the world, building the model and the DeepSpeed engine, the
ZeRO-3 policy gathered for generation),
`batches` (which windows each data-parallel rank reads at each step),
`checkpoints`, `integrity` and `lock` (fingerprinted, verified, one-writer
checkpoints), `metrics` (the JSON-lines log, TensorBoard, progress, the finite
check), `evaluation` (the validation loss and greedy task scores) and `loop`
(the skeleton around both training loops' steps: resume, cadences, outputs).
Nothing here imports a stage (pretrain, grpo, consolidate).
"""
