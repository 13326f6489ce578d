"""Peak memory per device of one layout: model states, activations, logits, buffers.

Model states follow DeepSpeed's own estimators
(deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs and
stage3.estimate_zero3_model_states_mem_needs; tests compare against them). With
16-bit training a parameter costs 2 bytes of weights, 2 of gradients and 12 of
fp32 master weights and Adam moments; ZeRO partitions over the dp ranks:
  stage 0: 16 N        stage 1: 4 N + 12 N / dp
  stage 2: 2 N + 18 N / dp (16-bit and fp32 gradient partitions, as DeepSpeed counts them)
  stage 3: 18 N / dp + 4 * largest module (the gathered working copy)
where N is the parameters one tensor-parallel rank holds. Under expert parallelism
(ep > 1, DeepSpeed AutoEP) a rank holds 1/ep of the routed experts, and ZeRO partitions
them over the dp/ep ranks that hold the same ones: the partitioned terms stay N_all / dp
(N_all the whole model's parameters), while the whole terms (weights, ZeRO 0-1 gradients)
count the rank's own N = N_all - (1 - 1/ep) x the routed experts' parameters.

Activations are what transformers' Llama block saves for its backward pass, counted from
the tensors autograd keeps (`torch.autograd.graph.saved_tensors_hooks`; the test
test_activations_are_what_autograd_saves holds the count to it), with SDPA/flash attention,
which stores no s x s scores. In w-byte weights (2 in 16 bits, 4 in fp32), per token:
  each of the two RMSNorms: 4h + 2wh (an fp32 copy of its input, whatever the precision,
    the normalised input and its product with the weight, the next projection's input),
    replicated over tp (DeepSpeed AutoTP has no sequence parallelism);
  attention: w (h + 2 h_kv + h) / tp (the query, key and value after RoPE, the output);
  MLP: 4w f / tp (gate, its SiLU, up, and their product, the down projection's input).
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
count 4h + (10h + 6 h_kv + 8f) / tp in 16 bits; the fp32 norm copies make the block 12%
larger at Llama-3.2-1B's shape, and the GPU check's peak (74.3 GiB allocated where that
formula predicted 67.5) showed it. The final norm adds one norm's bytes. With full activation
checkpointing a layer keeps only its input, w s b h, and one layer's activations live again
during its recomputation.

The logits cost 10 bytes per element: 2 in 16 bits, 4 for the fp32 upcast
transformers' loss makes and 4 for its gradient.

Allowance: `reserved_gib` for the CUDA context, NCCL and workspaces, then
`fragmentation` of what remains; both from the parallelism config section.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrain.planning.plan import Layout
from stagetrain.planning.shape import ModelShape

GIB = 2**30
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's estimators' default for host memory


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """Bytes per device (and per node on the host) of one layout."""

    params: int
    grads: int
    optimizer: int
    zero_buffers: int
    activations: int
    logits: int
    extra: int
    """Stage-specific memory, e.g. GRPO's reference model and KV cache."""
    host_per_node: int
    """Host memory needed per node for CPU offload (0 without offload)."""

    @property
    def total(self) -> int:
        """Peak bytes per device."""
        return (
            self.params + self.grads + self.optimizer + self.zero_buffers
            + self.activations + self.logits + self.extra
        )  # fmt: skip


def params_per_rank(shape: ModelShape, tp: int, ep: int = 1) -> int:
    """Parameters one rank holds: decoder layers split by tp, embeddings replicated, and 1/ep of
    the routed experts (tp and ep > 1 never meet: AutoEP trains with tp 1)."""
    split = (shape.params - shape.embedding_params) // tp + shape.embedding_params
    return split - shape.expert_params + shape.expert_params // ep


def model_states(shape: ModelShape, layout: Layout) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, host bytes per node) for the layout's ZeRO stage and offload."""
    n = params_per_rank(shape, layout.tp, layout.ep)
    part = params_per_rank(shape, layout.tp)  # what ZeRO's partitions add up to, over dp
    dp, zero = layout.dp, layout.zero_stage
    half = layout.precision != "fp32"
    w = 2 if half else 4  # bytes per weight and per gradient
    opt = 12 if half else 8  # fp32 master + Adam m, v (fp32 training needs no master)
    largest = 4 * shape.largest_module_params
    per_node_ranks = layout.gpus_per_node
    nodes = max(1, layout.world // per_node_ranks)
    if layout.offload == "optimizer_and_params":
        host = int(part * 18 / nodes * ADDITIONAL_BUFFER_FACTOR)
        return largest, 0, 0, host
    if layout.offload == "optimizer":
        if zero == 3:
            host = int(part * 16 / nodes * ADDITIONAL_BUFFER_FACTOR)
            return largest + w * part // dp, 0, 0, host
        host = int(part * max(4 * layout.world, 16) * ADDITIONAL_BUFFER_FACTOR)
        return w * n, 0, 0, host
    if zero == 0:
        return w * n, w * n, opt * n, 0
    if zero == 1:
        return w * n, w * n, opt * part // dp, 0
    if zero == 2:
        return w * n, (w + 4) * part // dp, opt * part // dp, 0
    return w * part // dp + largest, 4 * part // dp, opt * part // dp, 0


def zero_buffers(
    layout: Layout, bucket_size: int, max_live: int, overlap_comm: bool, n: int
) -> int:
    """Communication buckets DeepSpeed allocates (overlap_comm keeps 4.5x, per its docs)."""
    w = 2 if layout.precision != "fp32" else 4
    if layout.zero_stage == 0:
        return 0
    factor = 4.5 if overlap_comm else 1.0
    buckets = int(2 * bucket_size * w * factor)
    if layout.zero_stage == 3:
        buckets += w * min(max_live, n)
    return buckets


def layer_activations(shape: ModelShape, layout: Layout, micro_batch: int | None = None) -> int:
    """Bytes one decoder layer stores for its backward pass."""
    s, b = layout.seq_len, micro_batch or layout.micro_batch_size
    h, tp = shape.hidden_size, layout.tp
    h_kv = shape.num_kv_heads * shape.head_dim
    f = shape.intermediate_size  # an MoE token's routed experts and shared expert together
    w = 2 if layout.precision != "fp32" else 4
    per_token = 2 * _norm(h, w) + w * (2 * h + 2 * h_kv + 4 * f) / tp
    return int(s * b * per_token)


def _norm(h: int, w: int) -> int:
    """Bytes per token an RMSNorm saves: its input in fp32, the normalised input, the product."""
    return 4 * h + 2 * w * h


def activations(shape: ModelShape, layout: Layout) -> int:
    """Bytes of stored activations for one micro batch over all layers and the final norm."""
    w = 2 if layout.precision != "fp32" else 4
    tokens = layout.seq_len * layout.micro_batch_size
    final = tokens * _norm(shape.hidden_size, w)
    one = layer_activations(shape, layout)
    if layout.activation_checkpointing:
        return shape.num_layers * tokens * shape.hidden_size * w + one + final
    return shape.num_layers * one + final


def logits(shape: ModelShape, layout: Layout) -> int:
    """Bytes of the logits, their fp32 copy for the loss and its gradient."""
    return 10 * layout.seq_len * layout.micro_batch_size * shape.vocab_size


def estimate(
    shape: ModelShape,
    layout: Layout,
    *,
    bucket_size: int,
    max_live: int,
    overlap_comm: bool,
    extra: int = 0,
) -> Memory:
    """The memory of `layout` per device; `extra` is added for stage-specific needs."""
    params, grads, optimizer, host = model_states(shape, layout)
    n = params_per_rank(shape, layout.tp)
    return Memory(
        params=params,
        grads=grads,
        optimizer=optimizer,
        zero_buffers=zero_buffers(layout, bucket_size, max_live, overlap_comm, n),
        activations=activations(shape, layout),
        logits=logits(shape, layout),
        extra=extra,
        host_per_node=host,
    )


def usable_bytes(device_bytes: int, reserved_gib: float, fragmentation: float) -> int:
    """Device memory the planner may fill: minus the reserve, minus the fragmentation share."""
    return int(max(0.0, device_bytes - reserved_gib * GIB) * (1.0 - fragmentation))
