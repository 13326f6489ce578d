rule render_deepspeed_config:
    input:
        after_detection,
        plan=f"{RUN}/plan/{{stage}}.json",
    output:
        deepspeed_config=f"{RUN}/deepspeed/{{stage}}.json",
    log:
        logged("render_deepspeed_config_{stage}"),
    benchmark:
        benchmarked("render_deepspeed_config_{stage}")
    params:
        code=code_of("render_deepspeed_config"),
        deepspeed=config["deepspeed"],
        training=get_training,
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/render_deepspeed_config.py"
