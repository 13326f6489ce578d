"""The curriculum MCTS/GRPO stage."""
