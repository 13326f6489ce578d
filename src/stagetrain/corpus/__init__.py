"""The training corpus: documents from each source (`sources`), templated prose (`prose`),
and their streaming tokenisation into memory-mapped shards (`shards`)."""
