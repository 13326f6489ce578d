rule pretrain:
    input:
        after_detection,
        plan=f"{RUN}/plan/pretrain.json",
        deepspeed_config=f"{RUN}/deepspeed/pretrain.json",
        tokenizer=rules.prepare_tokenizer.output.tokenizer,
        train=rules.prepare_tokenizer.output.train,
        val=rules.prepare_tokenizer.output.val,
        meta=rules.prepare_tokenizer.output.meta,
        model_config=rules.prepare_tokenizer.output.model_config,
        init_from=get_init_model,
    output:
        summary=f"{RUN}/pretrain/summary.json",
        metrics=f"{RUN}/pretrain/metrics.jsonl",
        loss_plot=reported(
            f"{RUN}/pretrain/loss.png",
            caption="../report/pretrain_loss.rst",
            category="Pretrain",
        ),
    log:
        logged("pretrain"),
    benchmark:
        benchmarked("pretrain")
    params:
        code=code_of("pretrain"),
        predicted=get_predicted("pretrain"),
        run=config["run"],
        model=config["model"],
        pretrain=config["pretrain"],
        tracking=config["tracking"],
    # The ranks use every core; running other jobs beside them would only slow both.
    threads: all_cores()
    # On Slurm: nodes, tasks, CPUs, GPUs and memory as plan.json says (profiles/slurm).
    resources:
        **plan_resources("pretrain"),
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/pretrain.py"
