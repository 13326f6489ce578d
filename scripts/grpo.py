"""grpo: declared in the workflow, not built yet (issue #6).

It fails with one line and writes nothing, so no placeholder artifact can be
mistaken for a real one.
"""

from stagetrain.stage import not_built, run_stage

run_stage(
    lambda io: not_built("grpo", "issue #6"), snakemake=globals().get("snakemake"), doc=__doc__
)
