"""Measured speed decides the precision and the attention kernel; CPU plans predict tokens/s;
GRPO's generation batch.

No test here depends on this machine's CPU: the choices are made from recorded
measurements (hardware.json's `speed`), one from an AVX2-only CPU that emulates
bf16 and one from a CPU with avx512_bf16. Only `test_measure_*` runs the real
benchmark, and asserts nothing about which precision wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness.planning import cpu_hardware, plan_for, preset_config
from harness.workflow import default_config

from stagetrain.hardware import speed
from stagetrain.hardware.catalog import gpu_spec
from stagetrain.hardware.report import SpeedReport
from stagetrain.planning import attention
from stagetrain.planning.precision import choose

# Recorded on two machines of the same kind (one thread, 512x512 products, GFLOP/s).
AVX2 = {"device": "cpu", "threads": 1, "size": 512, "capability": "AVX2", "flags": ["avx2"],
        "gflops": {"fp32": 61.4, "bf16": 0.9, "fp16": 0.6}}  # fmt: skip
AVX512_BF16 = {"device": "cpu", "threads": 1, "size": 512, "capability": "AVX512",
               "flags": ["avx2", "avx512f", "avx512_bf16"],
               "gflops": {"fp32": 99.8, "bf16": 204.9, "fp16": 2.3}}  # fmt: skip


def _cpu(measured: dict[str, Any] | None) -> dict[str, Any]:
    return {**cpu_hardware(), "speed": measured}


def test_auto_is_fp32_where_bf16_is_emulated() -> None:
    choice = choose("auto", None, AVX2)
    assert choice.precision == "fp32"
    assert "bf16 runs 0.01x fp32 here" in choice.reason and "fp32 61.4" in choice.reason
    assert "AVX2" in choice.reason
    assert not choice.warnings


def test_auto_is_bf16_where_bf16_is_clearly_faster() -> None:
    assert choose("auto", None, AVX512_BF16).precision == "bf16"


def test_bf16_must_be_clearly_faster_not_only_faster() -> None:
    marginal = {**AVX2, "gflops": {"fp32": 100.0, "bf16": 115.0, "fp16": 1.0}}
    assert choose("auto", None, marginal).precision == "fp32"


def test_auto_without_a_measurement_is_fp32_and_says_so() -> None:
    choice = choose("auto", None, None)
    assert choice.precision == "fp32" and "no measured speed" in choice.reason


def test_explicit_bf16_on_an_emulating_cpu_is_kept_with_the_slowdown_named() -> None:
    choice = choose("bf16", None, AVX2)
    assert choice.precision == "bf16"
    (warning,) = choice.warnings
    assert "68.2x slower than fp32 (0.9 vs 61.4 GFLOP/s)" in warning
    assert warning.startswith("deepspeed.precision: bf16 requested")


def test_gpus_follow_the_catalog() -> None:
    assert choose("auto", gpu_spec("H100"), None).precision == "bf16"
    assert choose("auto", gpu_spec("V100-32GB"), None).precision == "fp16"


def test_plan_of_the_default_config_on_each_kind_of_cpu() -> None:
    cfg = default_config()
    slow = plan_for(cfg, _cpu(AVX2))
    fast = plan_for(cfg, _cpu(AVX512_BF16))
    assert (slow["precision"], fast["precision"]) == ("fp32", "bf16")
    assert slow["precision_reason"].startswith("auto: bf16 runs 0.01x fp32")
    for plan in (slow, fast):
        assert plan["stages"]["pretrain"]["layout"]["precision"] == plan["precision"]
    forced = plan_for({**cfg, "deepspeed": {**cfg["deepspeed"], "precision": "bf16"}}, _cpu(AVX2))
    assert forced["precision"] == "bf16"
    assert any("68.2x slower than fp32" in w for w in forced["warnings"])


def test_cpu_plans_predict_tokens_per_s_from_the_measured_rate() -> None:
    cfg = default_config()

    def tokens_per_s(measured: dict[str, Any], precision: str = "auto") -> float:
        cfg["deepspeed"] = {**cfg["deepspeed"], "precision": precision}
        return plan_for(cfg, _cpu(measured))["stages"]["pretrain"]["throughput"]["tokens_per_s"]

    # Products twice as fast: faster training, but not twice (the non-matrix work stays).
    twice = {**AVX2, "gflops": {k: 2 * v for k, v in AVX2["gflops"].items()}}
    assert 1.3 < tokens_per_s(twice) / tokens_per_s(AVX2) < 1.9
    # bf16 products 2.05x fp32's: faster training, but not 2.05x.
    gain = tokens_per_s(AVX512_BF16, "bf16") / tokens_per_s(AVX512_BF16, "fp32")
    assert 1.2 < gain < 204.9 / 99.8
    unmeasured = plan_for(cfg, _cpu(None))["stages"]["pretrain"]["throughput"]
    assert "no measured speed" in unmeasured["reason"]


def test_cpu_plans_rank_candidates_by_predicted_speed() -> None:
    plan = plan_for(default_config(), _cpu(AVX2))["stages"]["pretrain"]
    assert (
        plan["layout"]["micro_batch_size"] == 16
    )  # the whole per-rank batch: fewest, largest products
    best = plan["throughput"]["tokens_per_s"]
    assert all(r["tokens_per_s"] <= round(best, 1) for r in plan["runners_up"])


# Attention forward and backward at speed.ATTENTION_SHAPE, one thread, ms: the 2-core EPYC with
# avx512_bf16 (2026-12-01), whose fused bf16 kernel ran 3-4x slower than the eager one.
EPYC_ATTENTION = {"fp32": {"sdpa": 8.7, "eager": 13.9}, "bf16": {"sdpa": 23.6, "eager": 7.1}}


def test_auto_attention_is_eager_only_where_it_was_measured_clearly_faster() -> None:
    measured = {**AVX512_BF16, "attention_ms": EPYC_ATTENTION}
    bf16 = attention.choose("auto", gpu=False, speed=measured, precision="bf16")
    assert bf16.attention == "eager" and "23.60 ms (sdpa) against 7.10 ms (eager)" in bf16.reason
    assert attention.choose("auto", gpu=False, speed=measured, precision="fp32").attention == "sdpa"
    marginal = {**measured, "attention_ms": {"bf16": {"sdpa": 11.0, "eager": 10.0}}}
    assert attention.choose("auto", gpu=False, speed=marginal, precision="bf16").attention == "sdpa"
    unmeasured = attention.choose("auto", gpu=False, speed=AVX512_BF16, precision="bf16")
    assert unmeasured.attention == "sdpa" and "no bf16 attention timing" in unmeasured.reason
    assert attention.choose("auto", gpu=True, speed=measured, precision="bf16").attention == "sdpa"
    assert attention.choose("eager", gpu=True, speed=None, precision="bf16").attention == "eager"


# A 2-core Sapphire Rapids with AMX, four detections (2026-12-05, quiet): bf16 products 6.8-6.9x
# fp32's, its eager bf16 attention 2.1-2.8x faster than sdpa, fp32 sdpa 1.5x faster than eager.
AMX_FLAGS = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]


def _amx(fp32: float, bf16: float, fp16: float, attention: tuple[float, ...]) -> dict[str, Any]:
    ms = dict(zip(("fp32 sdpa", "fp32 eager", "bf16 sdpa", "bf16 eager"), attention, strict=True))
    return {"device": "cpu", "threads": 1, "size": 512, "capability": "AVX512", "flags": AMX_FLAGS,
            "gflops": {"fp32": fp32, "bf16": bf16, "fp16": fp16},
            "attention_ms": {p: {k: ms[f"{p} {k}"] for k in ("sdpa", "eager")} for p in ("fp32", "bf16")}}  # fmt: skip


AMX = _amx(191.65, 1328.19, 204.31, (5.577, 8.289, 18.855, 9.085))
EPYC = {**AVX512_BF16, "attention_ms": EPYC_ATTENTION}
# The default config's pretraining, tokens/s over its 2 ranks as the stage measured it, with the
# detection its plan used (benchmarks/cpu_throughput.py; the EPYC's bf16 with eager attention from
# a default run). Measured over predicted was 0.65-1.39 while the non-matrix work was a share of
# the fp32 product rate and attention went at the matrix rate.
MEASURED_PRETRAINING = [
    (EPYC, "fp32", "sdpa", 14_237),  # 2026-11-30
    (EPYC, "bf16", "sdpa", 17_553),  # 2026-11-30
    (EPYC, "bf16", "eager", 24_483),  # 2026-12-03
    (_amx(180.72, 1238.38, 182.74, (5.715, 9.036, 19.261, 7.829)), "fp32", "sdpa", 20_674),
    (AMX, "bf16", "eager", 28_096),
    (_amx(169.78, 1182.85, 176.28, (6.1, 9.644, 19.785, 6.965)), "fp32", "sdpa", 19_178),
    (_amx(171.31, 1163.85, 174.13, (5.895, 8.757, 19.119, 6.716)), "bf16", "eager", 25_394),
    # The Sapphire Rapids held to AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2,
    # MKL_ENABLE_INSTRUCTIONS=AVX2; 2026-12-05): bf16 emulated, so auto trains in fp32.
    (
        {**_amx(110.9, 2.31, 2.73, (7.649, 11.101, 32.842, 80.306)), "capability": "AVX2"},
        "fp32",
        "sdpa",
        15_669,
    ),
]


def test_the_cpu_model_predicts_every_recorded_run_within_30_percent() -> None:
    """Issue 32's bound, on every CPU kind with a recorded training run: AMX's bf16 products run
    6.9x fp32's and its training 1.3-1.4x, the EPYC's 2.1x and 1.2-1.7x; held to AVX2 kernels,
    the same cores' fp32 products run 0.6x."""
    cfg = default_config()
    ratios = []
    for measured, precision, kernel, tokens_per_s in MEASURED_PRETRAINING:
        cfg["deepspeed"] = {**cfg["deepspeed"], "precision": precision, "attention": kernel}
        plan = plan_for(cfg, _cpu(measured))["stages"]["pretrain"]
        assert plan["layout"]["micro_batch_size"] == 16  # the measured runs' layout
        ratios.append(tokens_per_s / plan["throughput"]["tokens_per_s"])
    assert all(0.7 <= r <= 1.3 for r in ratios), ratios
    # The attention term is the one that separates the EPYC's two bf16 kernels.
    assert ratios[2] / ratios[1] < 24_483 / 17_553


def test_the_plan_carries_the_attention_kernel_to_every_part() -> None:
    from stagetrain.planning.derived import stage_plan

    cfg = default_config()
    plan = plan_for(cfg, _cpu({**AVX512_BF16, "attention_ms": EPYC_ATTENTION}))
    assert (plan["precision"], plan["attention"]) == ("bf16", "eager")
    assert all(stage_plan(plan, stage)["attention"] == "eager" for stage in ("pretrain", "grpo"))
    forced = {**cfg, "deepspeed": {**cfg["deepspeed"], "attention": "sdpa"}}
    assert (
        plan_for(forced, _cpu({**AVX512_BF16, "attention_ms": EPYC_ATTENTION}))["attention"]
        == "sdpa"
    )


def test_a_remeasured_machine_that_keeps_the_layouts_keeps_every_plan_part() -> None:
    """Two detections of one machine measure slightly different rates: the predictions move,
    the parts the stages depend on (`planning.derived`) must not, or every stage reruns."""
    from stagetrain.planning.derived import stage_plan

    cfg = default_config()
    faster = {**AVX512_BF16, "gflops": {k: v * 1.03 for k, v in AVX512_BF16["gflops"].items()}}
    a, b = plan_for(cfg, _cpu(AVX512_BF16)), plan_for(cfg, _cpu(faster))
    for stage in ("pretrain", "grpo"):
        assert a["stages"][stage]["throughput"] != b["stages"][stage]["throughput"]
        assert stage_plan(a, stage) == stage_plan(b, stage)


def test_measure_gives_every_precision_at_a_ranks_thread_count() -> None:
    hardware = {"gpu": None, "cpu_ranks": 2, "cpu": {"cores": 2}}
    before = torch.get_num_threads()
    result = speed.measure(hardware)
    assert torch.get_num_threads() == before  # the measurement's thread count is not left behind
    assert result["device"] == "cpu" and result["threads"] == 1
    assert set(result["gflops"]) == {"fp32", "bf16", "fp16"}
    assert all(v > 0 for v in result["gflops"].values())
    assert {k: set(v) for k, v in result["attention_ms"].items()} == {
        "fp32": {"sdpa", "eager"},
        "bf16": {"sdpa", "eager"},
    }
    assert all(ms > 0 for v in result["attention_ms"].values() for ms in v.values())
    assert result["capability"] == torch.backends.cpu.get_cpu_capability()
    # hardware.json's `speed` as `SpeedReport` names it: a CPU measurement has all but `reason`
    assert set(result) == (SpeedReport.__required_keys__ | SpeedReport.__optional_keys__) - {
        "reason"
    }


def test_cpu_flags_reads_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(
        "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\nprocessor\t: 1\n"
    )
    assert speed.cpu_flags(tmp_path) == ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    assert speed.cpu_flags(tmp_path / "absent") == []


# --- GRPO generation memory --------------------------------------------------------


class _Recording(torch.nn.Module):
    """A real tiny Llama whose `generate` records how many sequences each call makes."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
        self.model = LlamaForCausalLM(config).eval()
        self.batches: list[int] = []

    def generate(self, **kwargs: Any) -> torch.Tensor:
        self.batches.append(kwargs["input_ids"].shape[0] * kwargs.get("num_return_sequences", 1))
        return self.model.generate(**kwargs)

    def forward(self, **kwargs: Any) -> Any:
        """The tree's prefix cache prefills its misses with a plain forward pass."""
        return self.model(**kwargs)


@pytest.mark.parametrize("prompts_per_step", [16, 64])
def test_rollouts_generate_the_batch_the_plan_counted(prompts_per_step: int) -> None:
    from stagetrain.grpo.rollouts import flat_groups

    cfg = default_config()
    cfg["grpo"] = {**cfg["grpo"], "prompts_per_step": prompts_per_step, "max_new_tokens": 2}
    stage = plan_for(cfg, _cpu(AVX2))["stages"]["grpo"]
    planned, dp = stage["generation"]["batch"], stage["layout"]["dp"]
    model = _Recording()
    prompts = [[3, 4, 5]] * (
        prompts_per_step // dp
    )  # what one rank draws (grpo.steps.draw_problems)
    with torch.no_grad():
        flat_groups(model, prompts, lambda i, c: 0.0, keys=range(len(prompts)), group_size=cfg["grpo"]["group_size"],
                    max_new_tokens=2, temperature=1.0, top_p=1.0, eos_id=1, pad_id=0, max_batch=planned)  # fmt: skip
    assert max(model.batches) == planned
    assert sum(model.batches) == len(prompts) * cfg["grpo"]["group_size"]


def test_generation_batch_below_the_ranks_rollouts_is_generated_in_chunks() -> None:
    from stagetrain.grpo.rollouts import flat_groups

    model = _Recording()
    with torch.no_grad():
        groups = flat_groups(model, [[3, 4], [5, 6, 7], [8]], lambda i, c: float(i), keys=range(3), group_size=4,
                             max_new_tokens=2, temperature=1.0, top_p=1.0, eos_id=1, pad_id=0, max_batch=8)  # fmt: skip
    assert model.batches == [8, 4]
    assert [g.rewards for g in groups] == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def test_tree_rollouts_expand_every_trees_node_in_calls_of_at_most_the_planned_batch() -> None:
    from stagetrain.grpo.rollouts import tree_groups
    from stagetrain.grpo.tree import TreeConfig

    cfg = TreeConfig(branching=2, segment_tokens=2, max_leaves=6, max_tokens=100, max_new_tokens=6,
                     uct_c=1.0, eos_id=1)  # fmt: skip
    model = _Recording()
    with torch.no_grad():
        groups = tree_groups(model, [[3, 4], [5, 6, 7], [8], [9, 10]], lambda i, c: float(i % 2), cfg,
                             keys=range(4), temperature=1.0, top_p=1.0, pad_id=0, max_batch=6)  # fmt: skip
    expanded = sum(g.nodes for g in groups) // cfg.branching
    assert max(model.batches) == 6  # 3 nodes x B: the cap, not one node per call
    assert sum(model.batches) == expanded * cfg.branching
    assert len(model.batches) < expanded
    assert all(len(g.rewards) >= cfg.branching for g in groups)


def test_grpo_memory_counts_the_kv_cache_of_the_whole_generation_batch() -> None:
    def extra(prompts: int) -> int:
        cfg = preset_config("llama-1b-h200")
        cfg["grpo"] = {**cfg["grpo"], "prompts_per_step": prompts}
        return plan_for(cfg)["stages"]["grpo"]["memory"]["extra"]

    base = preset_config("llama-1b-h200")["grpo"]["prompts_per_step"]
    assert extra(2 * base) > extra(base)
