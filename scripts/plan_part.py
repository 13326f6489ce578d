"""plan_part: write one part of the plan, plan/vocab.json or plan/<stage>.json.

Snakemake passes the part as worked out while the DAG was built (stagetrain.planning.ahead);
the job reruns only when its bytes change, and so do the stages that read it. On its own,
the part is cut from a plan.json:
    python scripts/plan_part.py --config config/config.yaml \
        --plan results/tiny/plan.json --part results/tiny/plan/grpo.json
"""

from pathlib import Path

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json
from stagetrain.planning.derived import part_of
from stagetrain.workflow.stage import StageIO, run_stage


def main(io: StageIO) -> None:
    smk = globals().get("snakemake")
    name = Path(io.outputs["part"]).stem
    part = smk.params.part if smk is not None else part_of(io.read_input("plan"), name)
    if isinstance(part, str):
        raise StageError(part)  # the planner's refusal; plan_parallelism's log has it too
    atomic_write_json(io.outputs["part"], part)


run_stage(
    main, snakemake=globals().get("snakemake"), doc=__doc__, inputs=["plan"], outputs=["part"]
)
