rule consolidate:
    input:
        after_detection,
        summary=f"{RUN}/{{stage}}/summary.json",
        plan=f"{RUN}/plan/{{stage}}.json",
        tokenizer=rules.prepare_tokenizer.output.tokenizer,
        model_config=rules.prepare_tokenizer.output.model_config,
        meta=rules.prepare_tokenizer.output.meta,
        # The verification reloads the model on the validation windows the stage recorded.
        val=rules.prepare_tokenizer.output.val,
    output:
        model=directory(f"{RUN}/model/{{stage}}"),
    log:
        logged("consolidate_{stage}"),
    benchmark:
        benchmarked("consolidate_{stage}")
    resources:
        **plan_resources("consolidate"),
    params:
        code=code_of("consolidate"),
        consolidate=config["consolidate"],
        tracking=tracking_of_models(),
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/consolidate.py"
