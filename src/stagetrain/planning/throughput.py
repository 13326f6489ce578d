"""Predicted step time and tokens/s of one layout on GPUs.

compute   FLOPs per token 6 N_active + 12 L h s (PaLM, Chowdhery et al. 2022,
          appendix B), times 4/3 with activation checkpointing (one more forward),
          at `assumed_mfu` of the catalog's dense peak, scaled by n / (n + 256)
          for n tokens per micro batch: small GEMMs do not fill the tensor cores.
dp comm   ring collectives moving 2 (dp-1)/dp of the 16-bit gradients (ZeRO 0, 1:
          one all-reduce per step; ZeRO 2: a reduce-scatter per micro batch and a
          parameter all-gather per step; ZeRO 3: two parameter all-gathers and a
          gradient reduce-scatter per micro batch), over NVLink inside a node and
          `inter_node_gbps` between nodes; overlapped with the backward pass
          (ZeRO 3 prefetch: with the whole step) when overlap_comm is on.
tp comm   four all-reduces of s b h activations per layer per micro batch (six
          with recomputation), never overlapped.
offload   the optimizer step on the host at 1e9 parameters/s, plus gradients and
          weights over PCIe; parameter offload moves weights every micro batch.
These are ranking models: they order candidates well and give a magnitude, not a
promise; the pretrain stage logs the measured tokens/s and MFU to compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrain.hardware.catalog import GpuSpec
from stagetrain.planning.memory import params_per_rank
from stagetrain.planning.plan import Layout
from stagetrain.planning.shape import ModelShape

HOST_ADAM_PARAMS_PER_S = 1e9
GEMM_HALF_SATURATION_TOKENS = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """Predicted seconds per optimizer step, split by cause, and the resulting rates."""

    compute_s: float
    dp_comm_s: float
    """Exposed (not overlapped) data-parallel communication."""
    tp_comm_s: float
    offload_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (without recomputation) per second over the peak of all devices."""

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute_s + self.dp_comm_s + self.tp_comm_s + self.offload_s


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token without recomputation: 6 N + 12 L h s."""
    return 6 * shape.active_params + 12 * shape.num_layers * shape.hidden_size * seq_len


def predict(
    shape: ModelShape,
    layout: Layout,
    gpu: GpuSpec,
    *,
    nodes: int,
    inter_node_gbps: float,
    assumed_mfu: float,
    overlap_comm: bool,
) -> Throughput:
    """Predict the step time of `layout` on `nodes` nodes of `gpu`."""
    peak = gpu.peak_tflops * 1e12
    micro_tokens = layout.micro_batch_size * layout.seq_len
    efficiency = assumed_mfu * micro_tokens / (micro_tokens + GEMM_HALF_SATURATION_TOKENS)
    model_flops = flops_per_token(shape, layout.seq_len) * layout.tokens_per_step
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute = model_flops * recompute / (layout.world * peak * efficiency)

    n = params_per_rank(shape, layout.tp)
    w = 2 if layout.precision != "fp32" else 4
    intra = (gpu.nvlink_gbps or gpu.pcie_gbps) * 1e9
    dp_bw = min(intra, inter_node_gbps * 1e9) if nodes > 1 else intra
    ring = 2 * (layout.dp - 1) / layout.dp * n * w
    ga = layout.grad_accum
    volume = {0: ring, 1: ring, 2: ring / 2 * ga + ring / 2, 3: 1.5 * ring * ga}[layout.zero_stage]
    dp_time = volume / dp_bw
    hideable = compute if layout.zero_stage == 3 else compute * 2 / 3
    exposed = max(0.0, dp_time - hideable) if overlap_comm else dp_time

    allreduces = 6 if layout.activation_checkpointing else 4
    tp_bytes = 2 * (layout.tp - 1) / layout.tp * micro_tokens * shape.hidden_size * w
    tp_time = allreduces * shape.num_layers * tp_bytes * ga / intra

    offload = 0.0
    if layout.offload != "none":
        share = n / layout.dp
        offload = share / HOST_ADAM_PARAMS_PER_S + share * (4 + w) / (gpu.pcie_gbps * 1e9)
        if layout.offload == "optimizer_and_params":
            offload += 3 * share * w * ga / (gpu.pcie_gbps * 1e9)

    step = compute + exposed + tp_time + offload
    tokens_per_s = layout.tokens_per_step / step
    return Throughput(
        compute_s=compute,
        dp_comm_s=exposed,
        tp_comm_s=tp_time,
        offload_s=offload,
        tokens_per_s=tokens_per_s,
        mfu=flops_per_token(shape, layout.seq_len) * tokens_per_s / (layout.world * peak),
    )
