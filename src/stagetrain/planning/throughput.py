"""Predicted step time and tokens/s of one layout, on GPUs or CPU ranks.

compute   FLOPs per token 6 N_active + 12 L h s (PaLM, Chowdhery et al. 2022,
          appendix B), times 4/3 with activation checkpointing (one more forward),
          at an efficiency share of one device's peak, scaled by n / (n + n_half)
          for n tokens per micro batch: small matrix products do not fill the
          units. GPUs: the catalog's dense peak at `assumed_mfu`, n_half 256.
          CPU ranks: the GFLOP/s detect_hardware measured in the training
          precision at a rank's thread count, at `cpu_efficiency`, n_half 64,
          plus the work that is not matrix products (norms, activations,
          the optimizer, the framework) at CPU_OTHER_S_PER_FLOP, whatever
          the precision and the CPU (two kinds measured). Attention
          (the 12 L h s) runs at the rate detect_hardware's attention probe
          measured in the plan's precision and kernel, not the matrix rate:
          it is small batched products and a softmax, and AMX's bf16 products
          (6-8x fp32's) or bf16 sdpa on an EPYC (3.3x eager's time) move it
          far from that rate. Without these terms bf16 would be predicted 2.5x
          (EPYC) to 6x (AMX) faster where training measured 1.2-1.7x.
dp comm   ring collectives moving 2 (dp-1)/dp of the 16-bit gradients (ZeRO 0, 1:
          one all-reduce per step; ZeRO 2: a reduce-scatter per micro batch and a
          parameter all-gather per step; ZeRO 3: two parameter all-gathers and a
          gradient reduce-scatter per micro batch), over NVLink inside a node and
          `inter_node_gbps` between nodes; overlapped with the backward pass
          (ZeRO 3 prefetch: with the whole step) when overlap_comm is on. CPU
          ranks reduce through shared memory with the cores that compute, so
          nothing is hidden there.
tp comm   four all-reduces of s b h activations per layer per micro batch (six
          with recomputation), never overlapped.
offload   the optimizer step on the host at 1e9 parameters/s, plus gradients and
          weights over PCIe; parameter offload moves weights every micro batch.
These are ranking models: they order candidates well and give a magnitude, not a
promise; the training stages log the measured tokens/s next to the prediction
(benchmarks/cpu_throughput.py holds the CPU model to its measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrain.hardware.catalog import GpuSpec
from stagetrain.hardware.report import ATTENTION_SHAPE
from stagetrain.planning.memory import params_per_rank
from stagetrain.planning.plan import Layout
from stagetrain.planning.shape import ModelShape

HOST_ADAM_PARAMS_PER_S = 1e9
GPU_HALF_SATURATION_TOKENS = 256
CPU_HALF_SATURATION_TOKENS = 64
CPU_OTHER_S_PER_FLOP = 7.8e-12
"""Seconds of non-matrix work (norms, activations, the optimizer, the framework) per model FLOP
on a CPU rank, attention's FLOPs aside, whatever the CPU and the precision. Fitted with
`cpu_efficiency` 1.0 to seven runs of the default config's pretraining on two CPU kinds
(benchmarks/cpu_throughput.py, tests/test_precision.py): a 2-core EPYC with avx512_bf16 and a
2-core Sapphire Rapids with AMX, measured over predicted 0.86-1.16. Fixed rather than a share of
the measured fp32 product rate, as it was up to 2026-12-05: AMX's fp32 products ran 1.7-1.9x the
EPYC's while this work ran no faster, and in bf16 slower (as a share of the fp32 rate it fitted
the EPYC at 0.9-1.1 and AMX at 1.45-1.65). A CPU with much slower cores than these will train
slower than predicted."""
CPU_SHARED_MEMORY_GBPS = 10.0
"""Gradient reduction between CPU ranks of one machine (DeepSpeed's shared-memory op):
a memory-bandwidth order of magnitude, which is all a model of a ~1M-parameter
reduction needs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """What one device does per second: the figures the step-time model needs."""

    peak_flops: float
    """FLOP/s of one device (one CPU rank) in the training precision."""
    efficiency: float
    """Share of the peak a large micro batch reaches."""
    half_saturation_tokens: int
    """Tokens per micro batch at which half the efficiency is reached."""
    intra_gbps: float
    """Data- and tensor-parallel traffic inside a node, GB/s."""
    offload_gbps: float
    """Host <-> device transfers for offload, GB/s."""
    hides_comm: bool
    """Whether communication can overlap computation (GPUs: yes; CPU ranks: no)."""
    other_s_per_flop: float = 0.0
    """Seconds of work beside the matrix products per model FLOP (GPUs: inside assumed_mfu)."""
    attention_s_per_flop: float | None = None
    """Seconds per attention FLOP as the attention probe measured it (CPU ranks); None: attention
    is counted with the matrix products."""

    @classmethod
    def of_gpu(cls, gpu: GpuSpec, assumed_mfu: float) -> Rates:
        """A catalog GPU at the assumed share of its dense peak."""
        return cls(
            peak_flops=gpu.peak_tflops * 1e12, efficiency=assumed_mfu,
            half_saturation_tokens=GPU_HALF_SATURATION_TOKENS,
            intra_gbps=gpu.nvlink_gbps or gpu.pcie_gbps, offload_gbps=gpu.pcie_gbps, hides_comm=True,
        )  # fmt: skip

    @classmethod
    def of_cpu_rank(cls, gflops: float, cpu_efficiency: float, attention_ms: float | None) -> Rates:
        """One CPU rank at its measured matrix-product rate in the training precision (`gflops`),
        and `attention_ms` the attention probe's time in that precision and the plan's kernel."""
        batch, heads, seq, head_size = ATTENTION_SHAPE
        probe_flops = attention_flops_per_token(heads * head_size, seq, layers=1) * batch * seq
        return cls(
            peak_flops=gflops * 1e9, efficiency=cpu_efficiency,
            half_saturation_tokens=CPU_HALF_SATURATION_TOKENS,
            intra_gbps=CPU_SHARED_MEMORY_GBPS, offload_gbps=CPU_SHARED_MEMORY_GBPS, hides_comm=False,
            other_s_per_flop=CPU_OTHER_S_PER_FLOP,
            attention_s_per_flop=None if attention_ms is None else attention_ms * 1e-3 / probe_flops,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """Predicted seconds per optimizer step, split by cause, and the resulting rates."""

    compute_s: float
    dp_comm_s: float
    """Exposed (not overlapped) data-parallel communication."""
    tp_comm_s: float
    ep_comm_s: float
    """All-to-all of routed tokens between the ranks of an ep group (ep > 1)."""
    offload_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (without recomputation) per second over the peak of all devices."""

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute_s + self.dp_comm_s + self.tp_comm_s + self.ep_comm_s + self.offload_s


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token without recomputation: 6 N + 12 L h s."""
    return 6 * shape.active_params + attention_flops_per_token(
        shape.hidden_size, seq_len, layers=shape.num_layers
    )


def attention_flops_per_token(hidden_size: int, seq_len: int, *, layers: int) -> float:
    """The attention's share of `flops_per_token`: 12 L h s (scores and values, forward and
    backward)."""
    return 12 * layers * hidden_size * seq_len


def predict(
    shape: ModelShape,
    layout: Layout,
    rates: Rates,
    *,
    nodes: int,
    inter_node_gbps: float,
    overlap_comm: bool,
) -> Throughput:
    """Predict the step time of `layout` on `nodes` nodes of devices that run at `rates`."""
    peak = rates.peak_flops
    micro_tokens = layout.micro_batch_size * layout.seq_len
    efficiency = rates.efficiency * micro_tokens / (micro_tokens + rates.half_saturation_tokens)
    per_token = flops_per_token(shape, layout.seq_len)
    attention, attention_s = 0.0, 0.0  # unmeasured: attention counts with the matrix products
    if rates.attention_s_per_flop is not None:
        attention = attention_flops_per_token(
            shape.hidden_size, layout.seq_len, layers=shape.num_layers
        )
        attention_s = attention * rates.attention_s_per_flop
    seconds_per_token = (per_token - attention) * (
        1 / (peak * efficiency) + rates.other_s_per_flop
    ) + attention_s
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute = layout.tokens_per_step * recompute / layout.world * seconds_per_token

    n = params_per_rank(shape, layout.tp)
    w = 2 if layout.precision != "fp32" else 4
    intra = rates.intra_gbps * 1e9
    dp_bw = min(intra, inter_node_gbps * 1e9) if nodes > 1 else intra
    # Under ep, a rank's routed experts are reduced over the dp / ep ranks that hold them.
    experts, ep_dp = shape.expert_params // layout.ep, layout.dp // layout.ep
    ring = 2 * w * ((layout.dp - 1) / layout.dp * (n - shape.expert_params)
                    + (ep_dp - 1) / ep_dp * experts)  # fmt: skip
    ga = layout.grad_accum
    volume = {0: ring, 1: ring, 2: ring / 2 * ga + ring / 2, 3: 1.5 * ring * ga}[layout.zero_stage]
    dp_time = volume / dp_bw
    hideable = compute if layout.zero_stage == 3 else compute * 2 / 3
    exposed = max(0.0, dp_time - hideable) if overlap_comm and rates.hides_comm else dp_time

    allreduces = 6 if layout.activation_checkpointing else 4
    tp_bytes = 2 * (layout.tp - 1) / layout.tp * micro_tokens * shape.hidden_size * w
    tp_time = allreduces * shape.num_layers * tp_bytes * ga / intra

    # Each MoE layer sends a micro batch's routed token slots to their experts' ranks and back,
    # in the forward and the backward (and the recomputed forward); all but 1/ep leave the rank.
    all_to_alls = 6 if layout.activation_checkpointing else 4
    ep_bytes = (
        (layout.ep - 1) / layout.ep * micro_tokens * shape.experts_per_token * shape.hidden_size * w
    )
    ep_bw = intra if layout.ep <= layout.gpus_per_node else dp_bw
    ep_time = all_to_alls * shape.moe_layers * ep_bytes * ga / ep_bw

    offload = 0.0
    if layout.offload != "none":
        share = n / layout.dp
        offload = share / HOST_ADAM_PARAMS_PER_S + share * (4 + w) / (rates.offload_gbps * 1e9)
        if layout.offload == "optimizer_and_params":
            offload += 3 * share * w * ga / (rates.offload_gbps * 1e9)

    step = compute + exposed + tp_time + ep_time + offload
    tokens_per_s = layout.tokens_per_step / step
    return Throughput(
        compute_s=compute,
        dp_comm_s=exposed,
        tp_comm_s=tp_time,
        ep_comm_s=ep_time,
        offload_s=offload,
        tokens_per_s=tokens_per_s,
        mfu=flops_per_token(shape, layout.seq_len) * tokens_per_s / (layout.world * peak),
    )
