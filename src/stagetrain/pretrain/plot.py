"""The loss curve the Snakemake report shows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagetrain.pretrain.summary import PretrainSummary


def loss_plot(summary: PretrainSummary, path: str | Path) -> None:
    """Training loss per logged step and validation loss, as a PNG; for an MoE model also the
    expert load (the busiest expert's share over the mean, averaged over MoE layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = {int(k): v for k, v in summary["losses"].items()}
    evals = {int(k): v for k, v in summary["eval_losses"].items()}
    ax.plot(list(train), list(train.values()), label="train")
    ax.plot(list(evals), list(evals.values()), "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{summary['stage']}: final validation loss {summary['final_eval_loss']:.3f}")
    handles, labels = ax.get_legend_handles_labels()
    if experts := summary.get("experts"):
        load = {int(k): v for k, v in experts["load_max_over_mean"].items()}
        twin = ax.twinx()
        twin.plot(
            list(load),
            list(load.values()),
            color="C3",
            alpha=0.7,
            label="expert load (busiest / mean)",
        )
        twin.set_ylabel(f"busiest expert / mean (1 balanced, {experts['experts']} collapsed)")
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
