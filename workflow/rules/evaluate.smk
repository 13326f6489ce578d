# Optional (`snakemake --cores all evaluate`, not part of `all`): lm-evaluation-harness on a
# consolidated model folder, with the run's held-out problems as local tasks (stagetrain.evaluate.lmeval).
rule evaluate_model:
    input:
        after_detection,
        model=f"{RUN}/model/{{stage}}",
        meta=rules.prepare_tokenizer.output.meta,
        task_files=get_task_files,
        reward_files=get_reward_files,
    output:
        evaluation=f"{RUN}/evaluate/{{stage}}.json",
        table=reported(
            f"{RUN}/evaluate/{{stage}}.tsv",
            caption="../report/evaluate.rst",
            category="Evaluation",
            subcategory="{stage}",
        ),
        # The same table as a page: the report draws HTML in itself, and a TSV only as a download.
        page=reported(
            f"{RUN}/evaluate/{{stage}}.html",
            caption="../report/evaluate.rst",
            category="Evaluation",
            subcategory="{stage}",
        ),
    log:
        logged("evaluate_{stage}"),
    benchmark:
        benchmarked("evaluate_{stage}")
    params:
        code=code_of("evaluate"),
        run=config["run"],
        tasks=config["tasks"],
        evaluate=config["evaluate"],
        # Of data and grpo, only what names the held-out families and the prompt lengths.
        data={"generated": {"families": config["data"]["generated"]["families"]}},
        grpo={key: config["grpo"][key] for key in ("max_prompt_len", "max_new_tokens")}
        | {"curriculum": {"families": config["grpo"]["curriculum"]["families"]}},
    threads: all_cores()
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/evaluate.py"
