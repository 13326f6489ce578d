"""The prepare_tokenizer stage: the tokenizer (`build`), and the token shards, meta file and model
config written with it (`prepare`, over `stagetrain.corpus`)."""
