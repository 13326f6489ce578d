# A checkpoint: once it has run, Snakemake re-evaluates the jobs after it, which
# read the small files under plan/ (rewritten only when their content changes),
# so a replan that leaves a stage's part alone does not rerun that stage.
checkpoint plan_parallelism:
    input:
        hardware=rules.detect_hardware.output.hardware,
        table=get_table,
        init_from=get_init_config,
    output:
        plan=f"{RUN}/plan.json",
        vocab=f"{RUN}/plan/vocab.json",
        pretrain_plan=f"{RUN}/plan/pretrain.json",
        grpo_plan=f"{RUN}/plan/grpo.json",
    log:
        logged("plan_parallelism"),
    benchmark:
        benchmarked("plan_parallelism")
    params:
        code=code_of("plan_parallelism"),
        hardware=config["hardware"],
        model=config["model"],
        tokenizer=get_plan_section("tokenizer"),
        parallelism=config["parallelism"],
        deepspeed=config["deepspeed"],
        pretrain=get_plan_section("pretrain"),
        grpo=get_plan_section("grpo"),
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/plan_parallelism.py"
