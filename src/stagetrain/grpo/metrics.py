"""The GRPO stage's metrics: every key of its metrics.jsonl, what it means and when it is logged.

`GrpoRecord` types a record with the same keys (tests/test_pretrain_unit.py holds the two equal).
"""

from typing import Required, TypedDict

from stagetrain.grpo.curriculum import CurriculumEvent

METRICS: dict[str, str] = {
    "step": "rollout batches completed; every record",
    "train/loss": "GRPO loss of the last optimisation pass, averaged over ranks; every record",
    "train/lr": "learning rate of the last optimizer step; every record",
    "reward/mean": "mean verifier reward over all completions of the step, all ranks; every record",
    "reward/std": "standard deviation of those rewards; every record",
    "reward/max": "largest reward of the step's completions, all ranks (the summary keeps the run's largest, to set against success_at); every record",
    "reward/solved": "share of the step's completions whose reward reached their family's success_at, all ranks; every record",
    "replay/share": "share of the step's prompts drawn from the replay families, all ranks (its expectation is grpo.replay.share); only with replay",
    "frac_reward_zero_std": "share of prompts whose completions all got the same reward (dropped from the loss); every record",
    "clip_ratio/low_mean": "share of completion tokens where the low clip (ratio < 1 - eps_low, A < 0) is active; every record",
    "clip_ratio/high_mean": "share of completion tokens where the high clip (ratio > 1 + eps_high, A > 0) is active; every record",
    "train/sampler_logprob_gap_mean": "mean |sampler - trainer| log-prob of the step's sampled completion tokens, all ranks, the trainer scoring before the step's update; every record",
    "train/sampler_logprob_gap_max": "largest such |sampler - trainer| log-prob difference of the step; every record",
    "train/sampler_kl": "mean k3 estimate of KL(sampler || trainer) per sampled token, from the same log-probs; every record",
    "moe/routing_flip_share": "share of (completion token, MoE layer) pairs whose top-k experts the trainer's forward, before the step's update, chose differently from the sampler's, all ranks; an MoE policy's rollouts, flat or tree, every record",
    "train/aux_loss": "the MoE policy's load-balancing loss (unweighted), mean over micro batches and ranks of the last pass; only when router_aux_loss_coef > 0",
    "kl": "mean k3 estimate of KL(policy || reference) per sampled token, every completion of every rank (groups without reward variance too); only when kl_coef > 0",
    "completions/mean_length": "mean completion length in tokens; every record",
    "completions/max_length": "longest completion of the step in tokens, all ranks: with flat rollouts, the decoding steps of the generate call that drew it (and every row beside it); every record",
    "completions/clipped_ratio": "share of the step's completions cut at grpo.max_new_tokens without an eos, all ranks; every record",
    "rollout/generated_tokens": "tokens generated for the step's rollouts, all ranks; every record",
    "rollout/largest_generate_call": "most sequences one generate call made for the step's rollouts, largest over ranks: at most the plan's generation batch, whose KV cache the plan counted; every record",
    "rollout/lockstep_generate_calls": "generate calls of the step's rollouts made with the ranks in lockstep (synced_gpus): ZeRO-3's partitions left in place (the plan's generation.gather per_token, where the whole policy gathered does not fit), or AutoEP's all-to-all (parallelism.ep > 1), largest over ranks; 0 otherwise; every record",
    "rollout/flat_equivalent_tokens": "tokens flat sampling would have generated for the same completions; tree mode only",
    "reward/by_level": "mean reward of the step's completions by task level ({level: reward}), all ranks; every record",
    "tree/leaves": "finished leaves scored over all prompts of the step; tree mode only",
    "tree/nodes": "tree nodes below the roots over all prompts of the step; tree mode only",
    "tree/tokens_per_leaf": "generated tokens per scored leaf (flat sampling: the mean completion length); tree mode only",
    "curriculum/level": "each family's current level when the step's prompts were drawn ({family: level}; earlier levels mixed in); every record",
    "curriculum/success_rate": "each family's success rate over its rolling window of current-level prompts, a prompt succeeding when most of its completions do ({family: rate}; the rate a change was decided on, null while the window is empty); every record",
    "curriculum/events": "the step's promotions and demotions, a list of {step, family, kind, from, to, success_rate, window}; when any happens",
    "eval/accuracy": "greedy accuracy on the fixed held-out problems, mean over families; at step 0, every eval_every steps and at the end",
    "eval/accuracy_by_family": "{family: greedy held-out accuracy}; with eval/accuracy",
    "throughput/tokens_per_s": "generated plus trained tokens per second over all ranks; every record",
    "time/elapsed_s": "seconds since this process started training; every record",
}

GrpoRecord = TypedDict(
    "GrpoRecord",
    {
        "step": Required[int],
        "train/loss": float,
        "train/lr": float,
        "reward/mean": float,
        "reward/std": float,
        "reward/max": float,
        "reward/solved": float,
        "replay/share": float,
        "frac_reward_zero_std": float,
        "clip_ratio/low_mean": float,
        "clip_ratio/high_mean": float,
        "train/sampler_logprob_gap_mean": float,
        "train/sampler_logprob_gap_max": float,
        "train/sampler_kl": float,
        "moe/routing_flip_share": float,
        "train/aux_loss": float,
        "kl": float,
        "completions/mean_length": float,
        "completions/max_length": int,
        "completions/clipped_ratio": float,
        "rollout/generated_tokens": int,
        "rollout/largest_generate_call": int,
        "rollout/lockstep_generate_calls": int,
        "rollout/flat_equivalent_tokens": int,
        "reward/by_level": dict[str, float],
        "tree/leaves": int,
        "tree/nodes": int,
        "tree/tokens_per_leaf": float,
        "curriculum/level": dict[str, int],
        "curriculum/success_rate": dict[str, float | None],
        "curriculum/events": list[CurriculumEvent],
        "eval/accuracy": float,
        "eval/accuracy_by_family": dict[str, float],
        "throughput/tokens_per_s": float,
        "time/elapsed_s": float,
    },
    total=False,
)
"""One record of GRPO's metrics.jsonl: a step's (`grpo.steps.step`, completed by the loop) or
the step-0 evaluation's, which holds only `step` and the eval keys; METRICS says when each
other key is there."""
