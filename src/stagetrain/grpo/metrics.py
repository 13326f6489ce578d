"""The GRPO stage's metrics: every key of its metrics.jsonl, what it means and when it is logged."""

METRICS: dict[str, str] = {
    "step": "rollout batches completed; every record",
    "train/loss": "GRPO loss of the last optimisation pass, averaged over ranks; every record",
    "train/lr": "learning rate of the last optimizer step; every record",
    "reward/mean": "mean verifier reward over all completions of the step, all ranks; every record",
    "reward/std": "standard deviation of those rewards; every record",
    "frac_reward_zero_std": "share of prompts whose completions all got the same reward (dropped from the loss); every record",
    "clip_ratio/low_mean": "share of completion tokens where the low clip (ratio < 1 - eps_low, A < 0) is active; every record",
    "clip_ratio/high_mean": "share of completion tokens where the high clip (ratio > 1 + eps_high, A > 0) is active; every record",
    "kl": "mean k3 estimate of KL(policy || reference) per token; only when kl_coef > 0",
    "completions/mean_length": "mean completion length in tokens; every record",
    "rollout/generated_tokens": "tokens generated for the step's rollouts, all ranks; every record",
    "rollout/flat_equivalent_tokens": "tokens flat sampling would have generated for the same completions; tree mode only",
    "curriculum/level": "task level of the step's prompts (earlier levels mixed in); every record",
    "curriculum/success_rate": "share of the step's current-level prompts answered correctly by most of their completions; every record",
    "curriculum/event": "a promotion or demotion, with the numbers that caused it; when one happens",
    "eval/accuracy": "greedy accuracy on the fixed held-out problems, mean over families; at step 0, every eval_every steps and at the end",
    "throughput/tokens_per_s": "generated plus trained tokens per second over all ranks; every record",
    "time/elapsed_s": "seconds since this process started training; every record",
}
