"""The planner: exact parameter counts, the memory model against DeepSpeed's estimators, the search, the errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from harness.configs import model_settings
from harness.planning import cpu_hardware, plan_for, preset_config
from harness.workflow import default_config
from transformers import AutoModelForCausalLM

from stagetrain.errors import StageError
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.hardware.detect import describe
from stagetrain.model.config import build_config, padded_vocab
from stagetrain.planning import memory as mem
from stagetrain.planning.derived import ESTIMATES, SHARED_KEYS, stage_plan
from stagetrain.planning.memory import Memory
from stagetrain.planning.plan import (
    Layout,
    LayoutRecord,
    MemoryRecord,
    ModelRecord,
    PlanPart,
    PlanRecord,
    RunWide,
    StageEstimates,
    StagePart,
    StagePlanRecord,
    ThroughputRecord,
)
from stagetrain.planning.resolve import PlannerSettings, demands
from stagetrain.planning.shape import ModelShape, cached_shape, model_shape, shape_key
from stagetrain.planning.throughput import Rates, Throughput, predict

GIB = 2**30
MOE = {
    "mixtral": {"num_experts": 4, "experts_per_token": 2},
    "qwen2_moe": {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64},
    "deepseek_v3": {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64, "num_shared_experts": 1,
                    "first_dense_layers": 1, "num_kv_heads": 4},
}  # fmt: skip


def _model(architecture: str = "llama", **changes: Any) -> dict[str, Any]:
    return {
        **default_config()["model"],
        "architecture": architecture,
        **MOE.get(architecture, {}),
        **changes,
    }


def _layout(**changes: Any) -> Layout:
    base = dict(
        world=8, gpus_per_node=8, dp=8, tp=1, micro_batch_size=2, grad_accum=4, global_batch=64,
        seq_len=1024, zero_stage=2, activation_checkpointing=False, offload="none", precision="bf16",
        num_heads=32, num_kv_heads=8,
    )  # fmt: skip
    return Layout(**{**base, **changes})


# --- parameter counts ---------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_exact(architecture: str, tied: bool) -> None:
    """The 1-and-2-layer extrapolation equals counting the whole model built on the meta device."""
    config = build_config(
        model_settings(_model(architecture, num_layers=5, tie_word_embeddings=tied)), 576
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params * 5 + shape.embedding_params + 128 == shape.params  # + final norm
    embed = 576 * 128
    assert shape.embedding_params == (embed if tied else 2 * embed)


def test_moe_active_parameters_count_only_routed_experts() -> None:
    config = build_config(model_settings(_model("mixtral", num_layers=3)), 512)
    shape = model_shape(config)
    experts = 3 * 4 * 3 * 128 * 512  # layers * experts * (gate, up, down) * hidden * intermediate
    assert shape.params - shape.active_params == experts // 2  # 2 of 4 experts unused per token


def test_moe_mlp_width_counts_the_routed_and_shared_experts_a_token_passes() -> None:
    """The width the activations are counted from: top-k routed experts plus the shared one
    (qwen2_moe's shared expert is intermediate_size wide; deepseek_v3's n_shared_experts are
    moe_intermediate_size wide), deepseek_v3's dense first layers averaged in."""
    mixtral = build_config(model_settings(_model("mixtral")), 512)
    qwen = build_config(model_settings(_model("qwen2_moe")), 512)
    deepseek = build_config(model_settings(_model("deepseek_v3")), 512)
    assert model_shape(mixtral).intermediate_size == 2 * 512
    assert model_shape(qwen).intermediate_size == 2 * 64 + 512
    assert (
        model_shape(deepseek).intermediate_size == (512 + 3 * (2 * 64 + 64)) // 4
    )  # one dense of four
    assert model_shape(build_config(model_settings(_model()), 512)).intermediate_size == 512


def test_a_deepseek_v3_shape_is_counted_whole_with_its_latent_attention() -> None:
    """Its first layer is dense, so the model is built whole; a query/key head is hidden / heads
    = 32 wide (16 unrotated, 16 rotary: transformers' config says head_dim 16, the rotary part
    alone), and a token's latent cache kv_lora_rank + qk_rope_head_dim (128 + 16), not
    2 x kv_heads x head_dim."""
    config = build_config(model_settings(_model("deepseek_v3", num_layers=5)), 576)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert routed == 4 * 4 * 3 * 128 * 64 and shape.params - shape.active_params == routed // 2
    assert (shape.head_dim, shape.num_kv_heads, shape.kv_cache_width) == (32, 4, 128 + 16)
    llama = model_shape(build_config(model_settings(_model()), 576))
    assert llama.kv_cache_width == 2 * 2 * 32  # keys and values of 2 KV heads of 32


def test_the_deepseek_preset_plans_the_hand_counted_parameters() -> None:
    """config/presets/deepseek-moe-h100.yaml against the count written out in docs/benchmarks.md
    (2026-12-02); one H100 cannot hold its optimizer, so the plan offloads it, and without
    host memory the refusal says that is what is short."""
    hidden, inter, vocab, layers, experts, heads = 2048, 5632, 32768, 16, 8, 32
    embeddings = 2 * vocab * hidden  # untied input embedding and output projection
    head = hidden // heads  # 64: q/k heads 32 unrotated + 32 rotary, v heads 64
    q_rank, kv_rank, rope = 12 * head, 4 * head, head // 2  # 768, 256, 32
    attention = (hidden * q_rank + q_rank + q_rank * heads * head  # q_a_proj, q_a_layernorm, q_b_proj
                 + hidden * (kv_rank + rope) + kv_rank  # kv_a_proj_with_mqa, kv_a_layernorm
                 + kv_rank * heads * (head // 2 + head)  # kv_b_proj: unrotated keys and values
                 + heads * head * hidden)  # o_proj  # fmt: skip
    assert attention == 8_717_312
    mlp = 3 * hidden * inter  # gate, up, down
    moe = experts * mlp + 1 * mlp + experts * hidden  # routed, shared, router
    norms = 2 * hidden
    total = embeddings + layers * (attention + norms) + mlp + (layers - 1) * moe + hidden
    assert total == 4_980_017_152
    plan = plan_for(preset_config("deepseek-moe-h100"))
    assert plan["model"]["params"] == total
    assert (
        plan["model"]["active_params"]
        == total - (layers - 1) * experts * mlp * 6 // 8
        == 1_865_746_432
    )
    assert (plan["model"]["head_dim"], plan["model"]["kv_cache_width"], plan["model"]["intermediate_size"]) == (
        64, 256 + 32, (inter + 15 * 3 * inter) // 16)  # fmt: skip
    pretrain = plan["stages"]["pretrain"]
    assert pretrain["layout"]["offload"] == "optimizer" and pretrain["memory"]["fits"]
    assert 16 * total > pretrain["memory"]["usable"]  # why: AdamW's states alone do not fit
    with pytest.raises(StageError, match=r"^pretrain: nothing fits; .* GiB of host memory per node for its offload, of none described \(hardware\.host_memory_gib\): use more or larger devices, more host memory"):  # fmt: skip
        plan_for(preset_config("deepseek-moe-h100", hardware={"host_memory_gib": None}))


def test_vocab_is_padded_to_multiple_times_tp() -> None:
    assert padded_vocab(500, 64) == 512
    assert padded_vocab(513, 64) == 576
    assert padded_vocab(513, 64, tp=4) == 768


def test_a_kept_shape_is_the_counted_one_and_any_edit_to_its_inputs_counts_again(
    tmp_path: Path,
) -> None:
    """The DAG keeps counted shapes across runs (planning.shape.cached_shape); a shape served
    from that folder for a model it was not counted for would plan the wrong memory."""
    model = model_settings(_model())
    counted: list[int] = []

    def count(settings: Any = model) -> ModelShape:
        counted.append(1)
        return model_shape(build_config(settings, 512))

    key = shape_key(model, 512, 1)
    first = cached_shape(tmp_path, key, count)
    assert cached_shape(tmp_path, key, count) == first and len(counted) == 1
    wider = model_settings({**_model(), "hidden_size": 256, "num_heads": 4})
    for other in (shape_key(wider, 512, 1), shape_key(model, 1024, 1), shape_key(model, 512, 2)):
        assert other not in (None, key)
    kept = cached_shape(tmp_path, shape_key(wider, 512, 1), lambda: count(wider))
    assert kept.hidden_size == 256 and len(counted) == 2
    (tmp_path / f"{key}.json").write_text("{")  # a torn file is counted again, not read
    assert cached_shape(tmp_path, key, count) == first and len(counted) == 3
    assert shape_key(replace(model, init_from="org/a-hub-model"), 512, 1) is None


# --- memory model -------------------------------------------------------------


@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_zero2_model_states_match_deepspeed(gpus: int) -> None:
    shape = model_shape(build_config(model_settings(_model()), 512))
    layout = _layout(
        world=gpus, gpus_per_node=min(gpus, 8), dp=gpus, global_batch=gpus * 8, zero_stage=2
    )
    params, grads, optimizer, _ = mem.model_states(shape, layout)
    _, expected = estimate_zero2_model_states_mem_needs(
        shape.params, num_gpus_per_node=min(gpus, 8), num_nodes=max(1, gpus // 8), cpu_offload=False
    )
    assert abs(params + grads + optimizer - expected) <= 2


@pytest.mark.parametrize("gpus", [1, 8, 64])
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer_and_params"])
def test_zero3_model_states_match_deepspeed(gpus: int, offload: str) -> None:
    shape = model_shape(build_config(model_settings(_model()), 512))
    layout = _layout(
        world=gpus,
        gpus_per_node=min(gpus, 8),
        dp=gpus,
        global_batch=gpus * 8,
        zero_stage=3,
        offload=offload,
    )
    params, grads, optimizer, host = mem.model_states(shape, layout)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        shape.params, shape.largest_module_params, num_gpus_per_node=min(gpus, 8),
        num_nodes=max(1, gpus // 8), cpu_offload=offload != "none",
        cpu_offload_params=offload == "optimizer_and_params",
    )  # fmt: skip
    assert abs(params + grads + optimizer - gpu) <= 2
    if offload != "none":
        assert abs(host - cpu) <= 2


def test_zero2_offload_matches_deepspeed() -> None:
    shape = model_shape(build_config(model_settings(_model()), 512))
    layout = _layout(zero_stage=2, offload="optimizer")
    params, grads, optimizer, host = mem.model_states(shape, layout)
    cpu, gpu = estimate_zero2_model_states_mem_needs(shape.params, 8, 1, cpu_offload=True)
    assert (params + grads + optimizer, host) == (gpu, cpu)


def test_more_sharding_never_needs_more_model_state_memory() -> None:
    shape = model_shape(build_config(model_settings(_model()), 512))
    totals = [sum(mem.model_states(shape, _layout(zero_stage=z))[:3]) for z in range(4)]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] == 16 * shape.params


def test_expert_parallelism_holds_a_share_of_the_experts_and_pays_their_all_to_all() -> None:
    """ep=2 halves what each rank holds whole of the routed experts (16-bit weights; ZeRO-1's
    gradients), while ZeRO's partitions still add up to the whole model over dp; the step
    pays the routed tokens' trip to their experts' ranks and back, forward and backward. GRPO's
    generation under ZeRO-3 gathers the policy with its share of the experts."""
    shape = model_shape(build_config(model_settings(_model("deepseek_v3")), 512))
    assert shape.num_experts == 4 and shape.moe_layers == 3 and shape.model_type == "deepseek_v3"
    assert 0 < shape.expert_params < shape.params
    half = shape.expert_params // 2
    for zero in (1, 2, 3):
        whole, split = (mem.model_states(shape, _layout(zero_stage=zero, ep=ep)) for ep in (1, 2))
        if zero == 3:
            assert split == whole
            continue
        assert split[0] == whole[0] - 2 * half and split[2] == whole[2], zero
        assert split[1] == (whole[1] - 2 * half if zero == 1 else whole[1]), zero
    rates = Rates(peak_flops=1e12, efficiency=1.0, half_saturation_tokens=0.0, intra_gbps=10.0,
                  other_s_per_flop=0.0, hides_comm=False, offload_gbps=1.0)  # fmt: skip
    layout = _layout(zero_stage=1, ep=2)  # 2 x 1024 tokens per micro batch, 4 micro batches
    speed = predict(shape, layout, rates, nodes=1, inter_node_gbps=10.0, overlap_comm=False)
    by_hand = 4 * 3 * (1 / 2 * 2 * 1024 * 2 * shape.hidden_size * 2) * 4 / 10e9
    assert speed.ep_comm_s == pytest.approx(by_hand)
    one = predict(
        shape, replace(layout, ep=1), rates, nodes=1, inter_node_gbps=10.0, overlap_comm=False
    )
    assert one.ep_comm_s == 0 and one.dp_comm_s > speed.dp_comm_s  # the experts reduce over dp/ep
    # GRPO under ZeRO-3: the policy gathered for generation holds its ep share of the experts;
    # the KL term's reference, built without AutoEP, all of them.
    cfg = preset_config("deepseek-moe-h100", grpo={"kl_coef": 0.05})
    settings = PlannerSettings.from_config(cfg)
    grpo = demands(settings.pretrain, settings.grpo, describe(settings.hardware))[1]
    extra = {ep: grpo.extra_bytes(shape, _layout(zero_stage=3, ep=ep)) for ep in (1, 2)}
    assert extra[1] - extra[2] == 2 * half
    without_kl = demands(
        settings.pretrain, replace(settings.grpo, kl_coef=0.0), describe(settings.hardware)
    )[1]
    assert extra[2] - without_kl.extra_bytes(shape, _layout(zero_stage=3, ep=2)) == 2 * (
        mem.params_per_rank(shape, 1) // 8
    )


def test_the_planner_splits_experts_where_autoep_can_and_grpo_with_flat_rollouts() -> None:
    """On two H100s without host memory the DeepSeek preset's micro batch of 2 fits at ep=2
    (ZeRO-1) and no longer under ZeRO-3 without ep, so the search takes ep=2; its Mixtral and
    qwen2_moe twins get ep candidates too; GRPO's search takes none. Fixed, ep=2 holds for pretraining and for GRPO's flat rollouts; GRPO's tree rollouts
    train at ep=1, with a warning."""
    two = {"gpus_per_node": 2, "host_memory_gib": None}
    plan = plan_for(preset_config("deepseek-moe-h100", hardware=two))
    searched = plan["stages"]["pretrain"]
    assert (searched["layout"]["ep"], searched["sources"]["ep"]) == (2, "planner"), searched
    rejected = [c["layout"] for c in searched["rejected"]]
    assert "tp=1 dp=2 zero=3 mbs=2 ga=32 ac=off offload=none" in rejected, rejected
    grpo = plan["stages"]["grpo"]  # its generation's all-to-all is not modelled: not searched
    tried = [c["layout"] for c in grpo["runners_up"] + grpo["rejected"]]
    assert grpo["layout"]["ep"] == 1 and tried and all(" ep=" not in c for c in tried), tried
    twins = {
        architecture: plan_for(preset_config(
            "deepseek-moe-h100", hardware={**two, "host_memory_gib": 256},
            model={"architecture": architecture, "num_shared_experts": None, "first_dense_layers": None,
                   "router_bias_update_rate": None} | ({"moe_intermediate_size": None} if architecture == "mixtral" else {}),
        ))["stages"]["pretrain"]
        for architecture in ("mixtral", "qwen2_moe")
    }  # fmt: skip
    tried = {a: [c["layout"] for c in p["runners_up"] + p["rejected"]] for a, p in twins.items()}
    for architecture, layouts in tried.items():
        assert any(" ep=2 " in layout for layout in layouts), (architecture, layouts)
    fixed = plan_for(preset_config("deepseek-moe-h100", hardware=two, parallelism={"ep": 2}))
    pretrain, grpo = fixed["stages"]["pretrain"], fixed["stages"]["grpo"]
    assert pretrain["layout"]["ep"] == 2 and pretrain["throughput"]["ep_comm_s"] > 0
    assert pretrain["sources"]["ep"] == "config"
    assert grpo["layout"]["ep"] == 2 and grpo["warnings"] == []  # flat rollouts, in lockstep
    tree = plan_for(preset_config("deepseek-moe-h100", hardware=two, parallelism={"ep": 2},
                                  grpo={"rollout": "tree"}))["stages"]["grpo"]  # fmt: skip
    assert tree["layout"]["ep"] == 1 and tree["warnings"] == [
        "grpo: trains with ep=1, not parallelism.ep=2: tree rollouts make "
        "different numbers of forwards on each rank, and every rank of an ep group must make the "
        "same; flat rollouts train at the config's ep"
    ]


@pytest.mark.parametrize(("experts", "splits"), [(6, {1, 2}), (12, {1, 2, 4}), (5, {1})])
def test_the_planner_tries_only_the_ep_values_that_divide_the_experts_and_the_ranks(
    experts: int, splits: set[int]
) -> None:
    """On 8 GPUs the data-parallel ranks split in 1, 2, 4 or 8 groups; an expert count that
    not every one divides (6, 12, a prime 5) leaves only the common divisors as candidates:
    an ep that does not divide the experts cannot give each rank whole experts."""
    eight = {"gpus_per_node": 8, "host_memory_gib": 256}
    plan = plan_for(
        preset_config("deepseek-moe-h100", hardware=eight, model={"num_experts": experts})
    )
    searched = plan["stages"]["pretrain"]
    layouts = [
        searched["layout"],
        *(c["layout"] for c in searched["runners_up"] + searched["rejected"]),
    ]
    tried = {int(m.group(1)) if (m := re.search(r" ep=(\d+)", c if isinstance(c, str) else "")) else 1
             for c in layouts[1:]} | {searched["layout"]["ep"]}  # fmt: skip
    assert tried <= splits and searched["layout"]["ep"] in splits, (tried, layouts[:5])
    assert len(tried) > 1 or splits == {1}, tried


def test_activation_formula_by_hand() -> None:
    """Per token and layer, 2 (4h + 2wh) + w (2h + 2 h_kv + 4f) / tp bytes; the final norm adds
    4h + 2wh (module docstring of planning.memory)."""
    shape = model_shape(
        build_config(model_settings(_model()), 512)
    )  # h=128, 4 heads, 2 kv heads (h_kv=64), f=512
    layout = _layout(
        seq_len=100, micro_batch_size=3, tp=2, dp=4, global_batch=48, num_heads=4, num_kv_heads=2
    )
    norm = 4 * 128 + 2 * 2 * 128
    assert mem.layer_activations(shape, layout) == 100 * 3 * (
        2 * norm + 2 * (2 * 128 + 2 * 64 + 4 * 512) / 2
    )
    assert mem.activations(shape, layout) == 4 * mem.layer_activations(shape, layout) + 300 * norm
    checkpointed = mem.activations(shape, replace(layout, activation_checkpointing=True))
    assert checkpointed == 4 * 100 * 3 * 128 * 2 + mem.layer_activations(shape, layout) + 300 * norm
    assert mem.logits(shape, layout) == 10 * 100 * 3 * 512


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward, weights aside,
    each storage once."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=tokens)
    return sum(kept.values())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_activations_are_what_autograd_saves(precision: str) -> None:
    """The planner's activation bytes are the tensors transformers' Llama keeps for its
    backward (SDPA): per layer, from a 3-layer model less a 1-layer one, and the rest (the
    final norm) from the 1-layer one. Within 1% and 2%: what the count leaves out does not
    grow with the width (the attention's fp32 log-sum-exp, 4 bytes per head and token; the
    norms' fp32 scales; the token ids and RoPE's tables). The GPU check found the textbook
    formula 10% short."""
    s, b = 64, 2
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(0))
    saved = {}
    for layers in (1, 3):
        config = build_config(model_settings(_model(num_layers=layers)), 512)
        config._attn_implementation = "sdpa"
        saved[layers] = _saved_bytes(
            AutoModelForCausalLM.from_config(config).to(dtype).train(), tokens
        )
    shape = model_shape(build_config(model_settings(_model(num_layers=1)), 512))
    layout = _layout(seq_len=s, micro_batch_size=b, tp=1, dp=1, world=1, gpus_per_node=1,
                     global_batch=b, grad_accum=1, precision=precision, num_heads=4, num_kv_heads=2)  # fmt: skip
    per_layer = (saved[3] - saved[1]) / 2
    assert per_layer == pytest.approx(mem.layer_activations(shape, layout), rel=0.01)
    assert saved[1] == pytest.approx(mem.activations(shape, layout), rel=0.02)


def test_usable_memory_subtracts_the_stated_allowance() -> None:
    assert mem.usable_bytes(80 * GIB, 2.0, 0.1) == int(78 * GIB * 0.9)
    assert mem.usable_bytes(1 * GIB, 2.0, 0.0) == 0  # a reserve larger than the device leaves none


def _odd_layout(**changes: Any) -> Layout:
    """Three ranks on nodes of two: dp does not divide the parameters, nodes are not whole."""
    base = dict(world=3, gpus_per_node=2, dp=3, global_batch=24, num_heads=None, num_kv_heads=None)
    return _layout(**{**base, **changes})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_states_are_the_documented_whole_bytes_of_each_part(precision: str) -> None:
    """Each part of the model states as the module docstring counts it, exactly and in whole
    bytes (integer division), in 16 bits (2-byte weights, 12 bytes of optimizer state) and in
    fp32 (4-byte weights, 8 bytes: no master copy), for every ZeRO stage and offload."""
    shape = model_shape(build_config(model_settings(_model()), 512))
    n, dp, largest = shape.params, 3, 4 * shape.largest_module_params
    w, opt = (2, 12) if precision == "bf16" else (4, 8)
    expected = {
        (0, "none"): (w * n, w * n, opt * n, 0),
        (1, "none"): (w * n, w * n, opt * n // dp, 0),
        (2, "none"): (w * n, (w + 4) * n // dp, opt * n // dp, 0),
        (3, "none"): (w * n // dp + largest, 4 * n // dp, opt * n // dp, 0),
        (2, "optimizer"): (w * n, 0, 0, int(n * 16 * 1.5)),  # max(4 * world, 16) = 16
        (3, "optimizer"): (largest + w * n // dp, 0, 0, int(n * 16 / 1 * 1.5)),  # 3 // 2 = 1 node
        (3, "optimizer_and_params"): (largest, 0, 0, int(n * 18 / 1 * 1.5)),
    }
    for (zero, offload), parts in expected.items():
        got = mem.model_states(
            shape, _odd_layout(zero_stage=zero, offload=offload, precision=precision)
        )
        assert got == parts and all(type(part) is int for part in got), (zero, offload)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero_buffers_and_activations_count_the_precisions_bytes(precision: str) -> None:
    shape = model_shape(build_config(model_settings(_model()), 512))
    w = 2 if precision == "bf16" else 4
    n, bucket, live = shape.params, 1001, 7
    for zero in (1, 2, 3):
        layout = _odd_layout(zero_stage=zero, precision=precision)
        for overlap, factor in ((True, 4.5), (False, 1.0)):
            expected = int(2 * bucket * w * factor) + (w * min(live, n) if zero == 3 else 0)
            assert mem.zero_buffers(layout, bucket, live, overlap, n) == expected, (zero, overlap)
    assert (
        mem.zero_buffers(_odd_layout(zero_stage=0, precision=precision), bucket, live, True, n) == 0
    )
    layout = _odd_layout(precision=precision)
    tokens, h = layout.seq_len * layout.micro_batch_size, shape.hidden_size
    final = tokens * (4 * h + 2 * w * h)
    assert (
        mem.activations(shape, layout)
        == shape.num_layers * mem.layer_activations(shape, layout) + final
    )


def test_a_ranks_parameters_are_whole_and_the_estimate_adds_no_extra_unasked() -> None:
    shape = model_shape(build_config(model_settings(_model("deepseek_v3")), 512))
    for tp, ep in ((1, 1), (3, 1), (1, 3)):
        held = mem.params_per_rank(shape, tp, ep)
        split = (shape.params - shape.embedding_params) // tp + shape.embedding_params
        assert held == split - shape.expert_params + shape.expert_params // ep and type(held) is int
    memory = mem.estimate(shape, _layout(), bucket_size=1000, max_live=10, overlap_comm=True)
    assert memory.extra == 0


# --- layout validation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp": 3}, "dp \\* tp must equal the world size \\(dp=3, tp=1, world=8"),
        ({"tp": 3, "dp": 8, "world": 24}, "parallelism.tp: must divide the attention and KV heads"),
        ({"tp": 16, "dp": 1, "world": 16, "num_heads": 32, "num_kv_heads": 16}, "parallelism.tp: must divide the 8 devices of one node"),
        ({"grad_accum": 3}, "global batch must equal micro_batch_size \\* grad_accum \\* dp .*global_batch=64"),
        ({"micro_batch_size": 0}, "every factor must be >= 1"),
        ({"offload": "optimizer", "zero_stage": 1}, "CPU offload needs zero_stage 2 or 3"),
        ({"offload": "optimizer_and_params", "zero_stage": 2}, "parameter offload needs zero_stage 3"),
    ],
)  # fmt: skip
def test_layout_errors_print_every_factor(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(StageError, match=message) as err:
        _layout(**changes)
    assert "heads=32, kv_heads=" in str(err.value)


# --- the search -------------------------------------------------------------------


def test_cpu_plan_uses_cpu_ranks_with_tp_1() -> None:
    cfg = default_config()
    plan = plan_for(cfg, cpu_hardware(ranks=2))
    assert (plan["world"], plan["backend"], plan["device"], plan["source"]) == (
        2,
        "gloo",
        "cpu",
        "estimated",
    )
    for name, stage in plan["stages"].items():
        layout = stage["layout"]
        assert (layout["dp"], layout["tp"]) == (2, 1), name
        assert layout["micro_batch_size"] * layout["grad_accum"] * 2 == layout["global_batch"]
    assert plan["stages"]["pretrain"]["layout"]["global_batch"] == 32
    assert plan["stages"]["grpo"]["layout"]["global_batch"] == 128  # 16 prompts x 8 completions
    assert (
        plan["model"]["params"]
        == model_shape(build_config(model_settings(cfg["model"]), 512)).params
    )


@pytest.mark.parametrize("preset", ["llama-1b-h200", "mistral-7b-8xh100", "deepseek-moe-h100"])
def test_presets_plan_within_memory(preset: str) -> None:
    plan = plan_for(preset_config(preset))
    for stage in plan["stages"].values():
        assert stage["memory"]["fits"] and stage["memory"]["total"] <= stage["memory"]["usable"]
        assert stage["throughput"]["tokens_per_s"] > 0
        assert stage["candidates"]["fit"] >= 1
        best = stage["throughput"]["tokens_per_s"]
        for other in stage["runners_up"]:
            assert other["tokens_per_s"] <= best + 0.1  # reported to 0.1 tokens/s
            assert other["reason"]
        for other in stage["rejected"]:
            assert other["reason"].startswith("does not fit")


def test_never_proposes_a_plan_that_does_not_fit() -> None:
    """Over a grid of models and devices, the chosen layout always fits its stated usable memory."""
    for gpu, per_node in [("A100-40GB", 8), ("L4", 4), ("H100", 8), ("H200", 1)]:
        for layers, hidden in [(16, 2048), (32, 4096)]:
            cfg = preset_config(
                "mistral-7b-8xh100",
                model={"num_layers": layers, "hidden_size": hidden},
                hardware={"gpu": gpu, "gpus_per_node": per_node},
            )
            try:
                plan = plan_for(cfg)
            except StageError as err:
                assert "nothing fits" in str(err)
                continue
            for stage in plan["stages"].values():
                assert stage["memory"]["total"] <= stage["memory"]["usable"], (gpu, layers)


def test_offload_only_when_nothing_else_fits() -> None:
    roomy = plan_for(preset_config("mistral-7b-8xh100"))
    assert all(s["layout"]["offload"] == "none" for s in roomy["stages"].values())
    tight = plan_for(
        preset_config(
            "mistral-7b-8xh100",
            hardware={"gpu": "L40S", "gpus_per_node": 1},
            grpo={"max_prompt_len": 128, "max_new_tokens": 128},
        )
    )
    pretrain = tight["stages"]["pretrain"]
    assert pretrain["layout"]["offload"] != "none"
    assert pretrain["layout"]["zero_stage"] >= 2
    assert pretrain["memory"]["fits"]


LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_layers": 80, "num_heads": 64,
             "num_kv_heads": 8}  # fmt: skip


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_grpo_gathers_per_token_only_where_the_whole_policy_does_not_fit(gpu: str) -> None:
    """A 70B Llama on 8 GPUs at tp=1: ZeRO-3's whole policy gathered for generation (7/8 of 140
    GB on each GPU) fits no layout, so GRPO's generation gathers per token, with a warning; the
    same model with tree rollouts, which cannot run in lockstep, is refused in one line. A
    7B on the same GPUs gathers the whole policy, as the default run's tiny model does."""
    grpo = {"prompts_per_step": 8, "group_size": 4, "max_prompt_len": 128, "max_new_tokens": 128}
    hardware = {"gpu": gpu, "gpus_per_node": 8, "host_memory_gib": 2048}
    cfg = preset_config(
        "mistral-7b-8xh100", model=LLAMA_70B, parallelism={"tp": 1}, hardware=hardware, grpo=grpo
    )
    plan = plan_for(cfg)
    stage = plan["stages"]["grpo"]
    assert stage["generation"]["gather"] == "per_token" and stage["layout"]["zero_stage"] == 3
    assert stage["memory"]["fits"] and stage["memory"]["total"] < 16 * 8 * 2**30 * 8 / 7  # no copy
    assert any("generation gathers each layer at every forward" in w for w in plan["warnings"])
    with pytest.raises(
        StageError, match=r"^grpo\.rollout: tree rollouts need the whole policy gathered"
    ):
        plan_for(merge_sections(cfg, grpo={"rollout": "tree"}))
    small = plan_for(
        preset_config("mistral-7b-8xh100", parallelism={"tp": 1}, hardware=hardware, grpo=grpo)
    )
    assert small["stages"]["grpo"]["generation"]["gather"] == "whole"
    default = plan_for(default_config(), cpu_hardware())
    assert default["stages"]["grpo"]["generation"]["gather"] == "whole"


def merge_sections(cfg: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, **{k: {**cfg[k], **v} for k, v in sections.items()}}


def test_nothing_fits_is_a_one_line_error() -> None:
    cfg = preset_config(
        "mistral-7b-8xh100", hardware={"gpu": "L4", "gpus_per_node": 1, "host_memory_gib": None}
    )
    with pytest.raises(
        StageError, match="pretrain: nothing fits; the smallest layout .* needs .* GiB per device"
    ):
        plan_for(cfg)


def test_a_requested_layout_that_does_not_fit_is_kept_with_a_warning() -> None:
    fixed = {
        "zero_stage": 0,
        "tp": 1,
        "dp": 8,
        "micro_batch_size": 4,
        "activation_checkpointing": False,
        "offload": "none",
    }
    cfg = preset_config("mistral-7b-8xh100", parallelism=fixed)
    plan = plan_for(cfg)
    pretrain = plan["stages"]["pretrain"]
    assert (pretrain["layout"]["zero_stage"], pretrain["layout"]["micro_batch_size"]) == (0, 4)
    assert not pretrain["memory"]["fits"]
    assert any("predicted not to fit" in w for w in plan["warnings"])
    assert plan["source"] == "config"


def test_config_values_fix_the_search_and_are_recorded() -> None:
    plan = plan_for(preset_config("mistral-7b-8xh100", parallelism={"tp": 2, "zero_stage": 1}))
    stage = plan["stages"]["pretrain"]
    assert (stage["layout"]["tp"], stage["layout"]["dp"], stage["layout"]["zero_stage"]) == (
        2,
        4,
        1,
    )
    assert stage["sources"]["tp"] == "config" and stage["sources"]["micro_batch_size"] == "planner"


def test_table_entry_is_used_below_config_values(tmp_path: Path) -> None:
    table = tmp_path / "parallelism_data.json"
    table.write_text(json.dumps({"H100": {"8": {"dp": 4, "tp": 2, "micro_batch_size": 1}}}))
    plan = plan_for(
        preset_config(
            "mistral-7b-8xh100", parallelism={"table_path": str(table), "micro_batch_size": 2}
        )
    )
    stage = plan["stages"]["pretrain"]
    assert (stage["layout"]["dp"], stage["layout"]["tp"], stage["layout"]["micro_batch_size"]) == (
        4,
        2,
        2,
    )
    assert stage["sources"]["tp"] == f"file:{table}"
    assert stage["sources"]["micro_batch_size"] == "config"
    assert plan["table"]["status"] == "used"


def test_table_miss_falls_back_with_the_reason_or_fails(tmp_path: Path) -> None:
    table = tmp_path / "parallelism_data.json"
    table.write_text(json.dumps({"A100-80GB": {"8": {"dp": 8, "tp": 1, "micro_batch_size": 1}}}))
    plan = plan_for(preset_config("mistral-7b-8xh100", parallelism={"table_path": str(table)}))
    assert plan["table"]["status"] == "miss"
    assert "no entry for H100 x 8 (the table has A100-80GB: 8)" in plan["table"]["reason"]
    assert plan["source"] == "estimated"
    with pytest.raises(StageError, match="no entry for H100 x 8"):
        plan_for(
            preset_config(
                "mistral-7b-8xh100",
                parallelism={"table_path": str(table), "on_table_miss": "error"},
            )
        )
    with pytest.raises(StageError, match="missing.json: file not found"):
        plan_for(
            preset_config(
                "mistral-7b-8xh100",
                parallelism={
                    "table_path": str(tmp_path / "missing.json"),
                    "on_table_miss": "error",
                },
            )
        )


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallelism": {"dp": 3}}, "dp \\* tp must equal the world size \\(dp=3, tp=None, world=8"),
        ({"parallelism": {"tp": 3}}, "tp: must divide the attention and KV heads \\(dp=None, tp=3, world=8, heads=32, kv_heads=8\\)"),
        ({"parallelism": {"dp": 8}, "pretrain": {"global_batch_size": 100}}, "pretrain: no layout divides the global batch of 100 sequences"),
        ({"pretrain": {"global_batch_size": 1000, "global_batch_unit": "tokens"}}, "pretrain.global_batch_size: 1000 tokens is not a multiple of pretrain.seq_len 4096"),
        ({"parallelism": {"micro_batch_size": 3}}, "global batch must equal micro_batch_size \\* grad_accum \\* dp"),
        ({"parallelism": {"dp": 8}, "grpo": {"prompts_per_step": 4}}, "grpo: no layout divides the global batch of 32 sequences \\(groups of 8\\)"),
        ({"deepspeed": {"precision": "bf16"}, "hardware": {"gpu": "V100-32GB"}}, "deepspeed.precision: bf16 requested but V100-32GB has no bf16 support"),
        ({"parallelism": {"tp": 2, "zero_stage": 3}}, "parallelism.tp: tp > 1 \\(DeepSpeed AutoTP\\) trains with ZeRO stages 0-2 only, not zero_stage 3 \\(dp=None, tp=2"),
        ({"parallelism": {"ep": 2}}, "^parallelism.ep: ep > 1 \\(DeepSpeed AutoEP\\) splits mixtral, qwen2_moe, deepseek_v3 only, not 'llama': a dense model has no experts to split$"),
    ],
)  # fmt: skip
def test_bad_plans_are_one_line_errors(sections: dict[str, dict[str, Any]], message: str) -> None:
    with pytest.raises(StageError, match=message) as err:
        plan_for(preset_config("mistral-7b-8xh100", **sections))
    assert "\n" not in str(err.value)


def test_an_ep_that_cannot_split_the_experts_is_one_line() -> None:
    with pytest.raises(StageError, match=r"^parallelism\.ep: must divide the 8 routed experts of each MoE layer \(dp=None, tp=None, world=16, heads=32, kv_heads=32, ep=16, experts=8\)$"):  # fmt: skip
        plan_for(
            preset_config(
                "deepseek-moe-h100", hardware={"gpus_per_node": 16}, parallelism={"ep": 16}
            )
        )


def test_unknown_detected_gpu_is_an_error_naming_the_catalog() -> None:
    hardware = describe(PlannerSettings.from_config(preset_config("mistral-7b-8xh100")).hardware)
    hardware["gpu"] = {**hardware["gpu"], "key": None, "name": "NVIDIA Z9000"}
    with pytest.raises(StageError, match="GPU 'NVIDIA Z9000' is not in the catalog"):
        plan_for(preset_config("mistral-7b-8xh100"), hardware)


def test_fp16_where_the_gpu_has_no_bf16() -> None:
    plan = plan_for(
        preset_config("llama-1b-h200", hardware={"gpu": "V100-32GB", "gpus_per_node": 8})
    )
    assert plan["precision"] == "fp16"
    assert gpu_spec("V100-32GB").peak_tflops == 125


def test_multi_node_plan_keeps_tp_inside_a_node() -> None:
    cfg = preset_config(
        "mistral-7b-8xh100", hardware={"nodes": 4}, pretrain={"global_batch_size": 512}
    )
    plan = plan_for(cfg)
    assert plan["world"] == 32
    for stage in plan["stages"].values():
        assert stage["layout"]["tp"] <= 8 and 8 % stage["layout"]["tp"] == 0
        assert stage["layout"]["dp"] * stage["layout"]["tp"] == 32


def test_gpu_check_preset_fits_one_h200_and_its_pretraining_fits_the_check_time() -> None:
    """tools/gpu/check.sh has under 8 minutes for the whole pipeline on one H200: the
    preset's pretraining must be planned to take well under a minute at the planned speed."""
    cfg = preset_config(
        "gpu-check-h200",
        hardware={"source": "describe", "gpu": "H200", "gpus_per_node": 1, "host_memory_gib": 128},
    )
    plan = plan_for(cfg)
    assert 0.9e9 < plan["model"]["params"] < 1.3e9  # a ~1B model
    for stage in plan["stages"].values():
        assert stage["memory"]["fits"] and stage["layout"]["precision"] == "bf16"
    pretrain = plan["stages"]["pretrain"]
    assert pretrain["throughput"]["step_s"] * cfg["pretrain"]["steps"] < 60


# --- plan.json's types ---------------------------------------------------------------


def test_the_records_that_copy_a_dataclass_name_its_fields() -> None:
    """LayoutRecord, MemoryRecord, ThroughputRecord and ModelRecord are cast from `asdict`:
    they must name exactly the dataclass's fields (and the keys added to them)."""
    names = {cls: {f for f in cls.__dataclass_fields__} for cls in (Layout, Memory, Throughput, ModelShape)}  # fmt: skip
    assert LayoutRecord.__required_keys__ == names[Layout] - {
        "num_heads",
        "num_kv_heads",
        "num_experts",
    }
    assert MemoryRecord.__required_keys__ == names[Memory] | {"total", "usable", "device", "fits"}
    assert ThroughputRecord.__required_keys__ == names[Throughput] | {"step_s"}
    assert ModelRecord.__required_keys__ == names[ModelShape] | {"vocab_multiple"}


def test_a_plan_has_the_keys_its_types_name() -> None:
    """plan.json and plan/<stage>.json, as the planner builds them, against their TypedDicts."""
    plan = plan_for(default_config(), cpu_hardware())
    assert set(SHARED_KEYS) == RunWide.__required_keys__
    assert set(ESTIMATES) == StageEstimates.__required_keys__
    assert set(plan) == PlanRecord.__required_keys__  # inputs_sha256 is added when written
    for name, stage in plan["stages"].items():
        optional = {"generation"} if name == "grpo" else set()
        assert set(stage) == StagePlanRecord.__required_keys__ | optional
        assert set(stage["layout"]) == LayoutRecord.__required_keys__
        part = stage_plan(plan, name)
        assert set(part) == PlanPart.__required_keys__
        assert set(part["stages"][name]) == StagePart.__required_keys__ | optional
