"""The training corpus: documents from each source (`sources`), templated prose (`prose`),
their streaming tokenisation into memory-mapped shards (`shards`), and data/meta.json's types
(`meta`)."""
