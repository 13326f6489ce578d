# Optional (`snakemake --cores all publish`, not part of `all`): both consolidated models, a model
# card and the layouts this run measured, pushed to `publish.repo` in one commit. A local rule:
# login nodes reach the hub, compute nodes often do not.
rule publish:
    input:
        publish_repo,
        after_detection,
        models=expand(f"{RUN}/model/{{stage}}", stage=TRAINING_STAGES),
        summaries=expand(f"{RUN}/{{stage}}/summary.json", stage=TRAINING_STAGES),
        plan=rules.plan_parallelism.output.plan,
        meta=rules.prepare_tokenizer.output.meta,
        metrics=rules.grpo.output.metrics,
    output:
        receipt=f"{RUN}/publish.json",
    log:
        logged("publish"),
    benchmark:
        benchmarked("publish")
    params:
        code=code_of("publish"),
        run=config["run"],
        model=config["model"],
        grpo=config["grpo"],
        tasks=config["tasks"],
        publish=config["publish"],
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/publish.py"
