"""The model to train: its transformers config from the `model` section (`config`), and its
embeddings resized to the padded vocabulary before DeepSpeed wraps it (`embeddings`)."""
