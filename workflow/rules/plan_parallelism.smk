# The plan is worked out while the DAG is built (common.smk: planned), so that a dry run
# knows which of its parts change. plan.json is the whole record (the `plan` target, the
# plan log); no stage reads it.
rule plan_parallelism:
    input:
        hardware=get_hardware,
        table=get_table,
        init_from=get_init_config,
    output:
        plan=f"{RUN}/plan.json",
    log:
        logged("plan_parallelism"),
    benchmark:
        benchmarked("plan_parallelism")
    params:
        code=code_of("plan_parallelism"),
        # Recorded in plan.json: the next DAG reads the plan instead of working it out again.
        key=planner_key,
        plan=get_plan,
        **planner_sections(config),
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/plan_parallelism.py"


# Each part of the plan a stage reads, its own job: it reruns, and so do its readers, only
# when the part's bytes change (the `digest` param, known before it runs).
rule plan_part:
    input:
        after_detection,
    output:
        part=f"{RUN}/plan/{{part}}.json",
    log:
        logged("plan_part_{part}"),
    params:
        code=code_of("plan_part"),
        digest=get_part_digest,
        part=get_part,
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/plan_part.py"
