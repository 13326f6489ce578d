"""stagetrain: a staged LLM training pipeline."""
