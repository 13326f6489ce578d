rule consolidate:
    input:
        summary=f"{RUN}/{{stage}}/summary.json",
        tokenizer=rules.prepare_tokenizer.output.tokenizer,
        model_config=rules.prepare_tokenizer.output.model_config,
    output:
        model=directory(f"{RUN}/model/{{stage}}"),
    log:
        logged("consolidate_{stage}"),
    benchmark:
        benchmarked("consolidate_{stage}")
    params:
        consolidate=config["consolidate"],
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/consolidate.py"
