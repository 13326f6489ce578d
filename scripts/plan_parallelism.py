"""plan_parallelism: write plan.json, how each training stage splits over the devices, and why.

Snakemake runs it through the `plan_parallelism` rule, with the plan it worked out while
building the DAG (stagetrain.planning.ahead) and `key`, the digest of the inputs the plan comes
from, recorded in plan.json so that the next DAG reads the plan instead of planning again.
On its own it plans:
    python scripts/plan_parallelism.py --config config/config.yaml \
        --hardware results/tiny/hardware.json --plan results/tiny/plan.json
"""

import logging

from stagetrain.errors import StageError
from stagetrain.planning.ahead import INPUTS_KEY, PLANNED_SECTIONS
from stagetrain.planning.plan import PlanRecord
from stagetrain.workflow.stage import StageIO, run_stage

log = logging.getLogger("stagetrain")


def main(io: StageIO) -> None:
    smk = globals().get("snakemake")
    plan: PlanRecord | str
    if smk is not None:
        plan = smk.params.plan
    else:  # the planner's import (torch, transformers' model classes) is paid only here
        from stagetrain.planning.resolve import plan_from

        plan = plan_from(io.read_input("hardware"), io.sections)
    if isinstance(plan, str):
        raise StageError(plan)  # the planner's refusal, found while the DAG was built
    _log(plan)
    io.write_output("plan", {**plan, INPUTS_KEY: smk.params.key if smk is not None else None})


def _log(plan: PlanRecord) -> None:
    """The plan in a few lines: the model, the devices, the choices and each stage's layout."""
    model = plan["model"]
    log.info(
        "model: %.3fB parameters (%.3fB active), %d layers, hidden %d",
        model["params"] / 1e9, model["active_params"] / 1e9, model["num_layers"], model["hidden_size"],
    )  # fmt: skip
    log.info(
        "devices: %d x %s, %s, plan source: %s",
        plan["world"],
        plan["device"],
        plan["precision"],
        plan["source"],
    )
    log.info("precision %s: %s", plan["precision"], plan["precision_reason"])
    log.info("attention %s: %s", plan["attention"], plan["attention_reason"])
    if plan["table"]["status"] not in ("none", "not needed"):
        log.info("table: %s", plan["table"].get("reason") or plan["table"].get("source"))
    for name, stage in plan["stages"].items():
        lay, mem, thr = stage["layout"], stage["memory"], stage["throughput"]
        log.info(
            "%s: dp=%d tp=%d zero=%d micro_batch=%d grad_accum=%d ac=%s offload=%s; "
            "%.2f of %.2f GiB usable per device; %s",
            name, lay["dp"], lay["tp"], lay["zero_stage"], lay["micro_batch_size"], lay["grad_accum"],
            lay["activation_checkpointing"], lay["offload"], mem["total"] / 2**30, mem["usable"] / 2**30,
            f"predicted {thr['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in thr else thr["reason"],
        )  # fmt: skip
        log.info(
            "  memory per device (GiB): params %.2f, grads %.2f, optimizer %.2f, ZeRO buffers %.2f, "
            "activations %.2f, logits %.2f, stage extra %.2f; host per node for offload %.2f",
            *(mem[k] / 2**30 for k in ("params", "grads", "optimizer", "zero_buffers", "activations",
                                       "logits", "extra", "host_per_node")),
        )  # fmt: skip
        for other in stage["runners_up"]:
            log.info("  runner-up %s: %s", other["layout"], other["reason"])
    for warning in plan["warnings"]:
        log.warning("warning: %s", warning)


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=["hardware"],
    outputs=["plan"],
    sections=PLANNED_SECTIONS,
)
