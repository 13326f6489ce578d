"""prepare_tokenizer: declared in the workflow, not built yet (issue #3).

It fails with one line and writes nothing, so no placeholder artifact can be
mistaken for a real one.
"""

from stagetrain.stage import not_built, run_stage

run_stage(
    lambda io: not_built("prepare_tokenizer", "issue #3"),
    snakemake=globals().get("snakemake"),
    doc=__doc__,
)
