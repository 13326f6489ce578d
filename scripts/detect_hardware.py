"""detect_hardware: write hardware.json, what this process may train on.

Snakemake runs it through the `detect_hardware` rule; on its own:
    python scripts/detect_hardware.py --config config/config.yaml --hardware results/tiny/hardware.json
"""

import logging

from stagetrain.config.settings import HardwareSettings
from stagetrain.hardware import speed
from stagetrain.hardware.detect import detect
from stagetrain.workflow.stage import StageIO, run_stage

log = logging.getLogger("stagetrain")


def main(io: StageIO) -> None:
    hardware = detect(HardwareSettings.from_config(io.sections["hardware"], "hardware"))
    for line in hardware["fallbacks"]:
        log.info("fallback: %s", line)
    for line in hardware["warnings"]:
        log.warning("warning: %s", line)
    gpu = hardware["gpu"]
    if gpu:
        log.info(
            "%d x %s (%s) per node on %d node(s), source %s",
            hardware["gpus_per_node"], gpu["name"], gpu["key"] or "not in catalog",
            hardware["nodes"], hardware["source"],
        )  # fmt: skip
    else:
        cpu = hardware["cpu"]
        log.info(
            "no GPU: %d CPU cores, %.1f GiB, planning %d CPU ranks per node on %d node(s)",
            cpu["cores"], cpu["memory_bytes"] / 2**30, hardware["cpu_ranks"], hardware["nodes"],
        )  # fmt: skip
    # Described hardware is not this machine: nothing here to measure.
    hardware["speed"] = None if hardware["source"] == "config" else speed.measure(hardware)
    if hardware["speed"] and hardware["speed"]["gflops"]:
        rates = hardware["speed"]["gflops"]
        spec = gpu and gpu["spec"]
        log.info(
            "matrix products (%s): %s GFLOP/s%s",
            f"{hardware['speed']['threads']} thread(s)" if not gpu else "first GPU",
            ", ".join(f"{k} {v:,.1f}" for k, v in rates.items()),
            f"; catalog dense peak bf16 {spec['bf16_tflops']:,.0f}, fp16 {spec['fp16_tflops']:,.0f} TFLOP/s"
            if spec
            else "",
        )
    io.write_output("hardware", hardware)


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    outputs=["hardware"],
    sections=["hardware"],
)
