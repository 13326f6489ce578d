rule grpo:
    input:
        after_detection,
        model=f"{RUN}/model/pretrain",
        plan=f"{RUN}/plan/grpo.json",
        deepspeed_config=f"{RUN}/deepspeed/grpo.json",
        tokenizer=rules.prepare_tokenizer.output.tokenizer,
        model_config=rules.prepare_tokenizer.output.model_config,
        meta=rules.prepare_tokenizer.output.meta,
        val=rules.prepare_tokenizer.output.val,
        task_files=get_task_files,
        reward_files=get_reward_files,
    output:
        summary=f"{RUN}/grpo/summary.json",
        metrics=f"{RUN}/grpo/metrics.jsonl",
        reward_plot=reported(
            f"{RUN}/grpo/reward.png",
            caption="../report/grpo_reward.rst",
            category="GRPO",
        ),
        completions=f"{RUN}/grpo/completions.jsonl",
        completions_table=reported(
            f"{RUN}/grpo/completions.html",
            caption="../report/grpo_completions.rst",
            category="GRPO",
        ),
    log:
        logged("grpo"),
    benchmark:
        benchmarked("grpo")
    params:
        code=code_of("grpo"),
        run=config["run"],
        grpo=config["grpo"],
        tasks=config["tasks"],
        tracking=config["tracking"],
    # The ranks use every core; running other jobs beside them would only slow both.
    threads: all_cores()
    # On Slurm: nodes, tasks, CPUs, GPUs and memory as plan.json says (profiles/slurm).
    resources:
        **plan_resources("grpo"),
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/grpo.py"
