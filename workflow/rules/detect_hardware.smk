# A checkpoint: the jobs that read the plan are built again once hardware.json is
# written, with their plan parts worked out from it (get_plan_part in common.smk).
checkpoint detect_hardware:
    output:
        hardware=f"{RUN}/hardware.json",
    log:
        logged("detect_hardware"),
    benchmark:
        benchmarked("detect_hardware")
    params:
        code=code_of("detect_hardware"),
        hardware=config["hardware"],
        # What CUDA may see is part of the input: a changed mask re-detects.
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    # On Slurm: as many nodes as training will use, so the detection job runs inside
    # such an allocation and records its node list (a one-node job keeps hardware.nodes).
    # One task per node: with a single task sbatch shrinks the job to one node.
    resources:
        nodes=config["hardware"]["nodes"],
        tasks=config["hardware"]["nodes"],
    conda:
        "../envs/stagetrain.yaml"
    script:
        "../../scripts/detect_hardware.py"
