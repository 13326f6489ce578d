"""Mixture-of-experts pretraining: the router is balanced (an aux loss, or DeepSeek-V3's routing
bias), and expert load is measured.

The maths of the load statistics on hand-made shares; the training loss against transformers'
own aux loss on a tiny Mixtral; the experts counted against the ones transformers' DeepseekV3
router chooses, bias and groups included; the bias update alone; and on two ranks, for each
MoE architecture offered, 100 steps with its balancing against the same run without it (aux
loss coefficient, or bias update rate, 0): the router must keep the experts more evenly loaded
over the run's second half, by the stage's own metrics. A deepseek_v3 run's bias survives a
resume and consolidation, and the folder loads and generates in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from harness.checkpoints import truncate
from harness.compare import PARAM_ATOL
from harness.configs import merge, model_settings, named_config
from harness.models import tiny_moe
from harness.training import (
    DEEPSEEK,
    MOE,
    assert_learning_signal,
    dp2,
    grpo_config,
    launch,
    launch_grpo,
    metric_records,
    model_config,
    run,
    run_grpo,
)
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.config.validation import validate_section
from stagetrain.consolidate.folder import consolidate
from stagetrain.errors import StageError
from stagetrain.grpo import steps as grpo_steps
from stagetrain.grpo.rollouts import flat_groups
from stagetrain.model.config import build_config
from stagetrain.pretrain.summary import PretrainSummary
from stagetrain.training import reshard
from stagetrain.training.autoep import autoep_names, gated_shared_expert, transformers_name
from stagetrain.training.batches import read_windows
from stagetrain.training.experts import (
    BIAS,
    Routing,
    balance_routers,
    bias_update,
    chosen_by_position,
    chosen_experts,
    expert_counts,
    expert_shares,
    load_stats,
    routed_by_position,
    router_biases,
    routing_of,
    training_loss,
)
from stagetrain.training.integrity import load_file
from stagetrain.training.metrics import scalars

QWEN_MOE = {"architecture": "qwen2_moe", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64,
            "intermediate_size": 128}  # fmt: skip
"""A tiny qwen2_moe: routed experts beside its shared expert (intermediate_size wide)."""


def test_load_stats_say_balanced_and_collapsed() -> None:
    even = load_stats(np.full((2, 4), 0.25))
    assert even["moe/load_entropy"] == pytest.approx(1.0)
    assert even["moe/load_max_over_mean"] == pytest.approx(1.0)
    collapsed = load_stats(np.array([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))
    assert collapsed["moe/load_entropy"] == pytest.approx((0.0 + 0.5) / 2)  # log 2 / log 4 = 0.5
    assert collapsed["moe/load_max_over_mean"] == pytest.approx((4.0 + 2.0) / 2)
    assert collapsed["moe/load_by_layer"] == [[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
    assert collapsed["moe/load_entropy_by_layer"] == pytest.approx({"0": 0.0, "1": 0.5})
    assert collapsed["moe/load_max_over_mean_by_layer"] == pytest.approx({"0": 4.0, "1": 2.0})


def test_each_layers_load_reaches_tensorboard_as_a_scalar() -> None:
    """TensorBoard takes scalars: the per-layer maps and the shares (layers x experts) are
    flattened to one curve each, the way `MetricsLog` writes a record's events."""
    record = {"step": 3, **load_stats(np.array([[1.0, 0.0], [0.25, 0.75]]))}
    curves = scalars(record)
    assert curves["moe/load_by_layer/1/1"] == 0.75 and curves["moe/load_by_layer/0/1"] == 0.0
    assert curves["moe/load_max_over_mean_by_layer/0"] == pytest.approx(2.0)
    assert curves["moe/load_entropy_by_layer/1"] == pytest.approx(0.8112781)
    assert (
        len([k for k in curves if k.startswith("moe/load_by_layer/")]) == 4 and "step" not in curves
    )


def test_expert_shares_count_each_tokens_top_k() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [3.0, 0.0, 2.0, -1.0], [0.0, 3.0, 2.0, -1.0]])
    counts = expert_counts([logits], Routing(experts=4, top_k=2, coef=0.01))
    assert counts.tolist() == [[2, 2, 2, 0]] and counts.dtype == torch.int64
    assert expert_shares(counts).tolist()[0] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


def test_a_routing_bias_changes_the_experts_counted() -> None:
    """The experts counted are the ones the router chose: the top-k of sigmoid(logits) + bias,
    not of the logits (the same logits as above, where expert 3 was never chosen)."""
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [3.0, 0.0, 2.0, -1.0], [0.0, 3.0, 2.0, -1.0]])
    routing = Routing(experts=4, top_k=2, coef=None, bias_rate=0.001)
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])
    assert expert_counts([logits], routing, [bias]).tolist() == [[2, 1, 0, 3]]
    assert expert_counts([logits], routing, [torch.zeros(4)]).tolist() == [[2, 2, 2, 0]]


@pytest.mark.parametrize(("groups", "top_groups"), [(1, 1), (4, 2)])
def test_the_experts_counted_are_the_ones_deepseeks_router_chooses(
    groups: int, top_groups: int
) -> None:
    """Against transformers' own DeepseekV3TopkRouter, with a bias and with group-limited routing
    (8 experts in 4 groups, the best 2 kept: a continued DeepSeek model may have them)."""
    config = build_config(
        model_settings({**named_config("tiny")["model"], **DEEPSEEK, "num_experts": 8}), 512
    )
    config.n_group, config.topk_group = groups, top_groups
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.1)
    router.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    hidden = torch.randn(64, 128)
    logits, _, indices = router(hidden)
    chosen = chosen_experts(logits, 2, router.e_score_correction_bias, groups, top_groups)
    assert torch.equal(chosen.sort(dim=-1).values, indices.sort(dim=-1).values)
    routing = routing_of(config)
    assert routing == Routing(
        experts=8, top_k=2, coef=None, bias_rate=0.001, groups=groups, top_groups=top_groups
    )
    counts = expert_counts([logits], routing, [router.e_score_correction_bias])
    assert counts.tolist() == [torch.bincount(indices.reshape(-1), minlength=8).tolist()]


def test_autoeps_names_turn_into_each_architectures_own_and_back() -> None:
    """AutoEP calls a shared expert `shared_experts.` and its gate `shared_experts_gate.` whatever
    the model did (training.autoep): a qwen2_moe's gated `shared_expert.` gains its s and loses
    it again, DeepSeek's ungated `shared_experts.` keeps its name both ways; the router's weight
    and the fused projection's halves are renamed as for every preset."""
    layer = "model.layers.0.mlp."
    qwen = [layer + n for n in ("shared_expert.up_proj.weight", "shared_expert_gate.weight",
                                "gate.weight", "experts.gate_up_proj", "experts.down_proj")]  # fmt: skip
    deepseek = [layer + n for n in ("shared_experts.up_proj.weight", "gate.weight",
                                    "gate.e_score_correction_bias")]  # fmt: skip
    for names in (qwen, deepseek):
        autoep = [a for n in names for a in autoep_names(n)]
        gated = gated_shared_expert(autoep)
        assert gated == gated_shared_expert(names) == (names is qwen)
        assert list(dict.fromkeys(transformers_name(a, gated) for a in autoep)) == names
    assert autoep_names(qwen[0]) == (layer + "shared_experts.up_proj.weight",)
    assert autoep_names(qwen[1]) == (layer + "shared_experts_gate.weight",)
    assert autoep_names(qwen[3]) == (layer + "experts.w1", layer + "experts.w3")
    assert autoep_names(deepseek[0]) == (deepseek[0],)


def test_autoeps_choices_give_each_position_the_experts_its_logits_give() -> None:
    """What AutoEP's routers return (one (rows x positions, top_k) per MoE layer, as a forward
    flattens its batch) lands at each row's and position's place, as the router logits do."""
    routing = Routing(experts=8, top_k=2, coef=None)
    logits = [torch.randn(3 * 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    chosen = [chosen_experts(layer, routing.top_k) for layer in logits]
    by_logits = chosen_by_position(logits, 3, routing)
    assert by_logits.shape == (3, 5, 4, 2)
    assert torch.equal(routed_by_position(chosen, 3, routing.top_k), by_logits)
    assert torch.equal(by_logits[1, 2, 3], logits[3][1 * 5 + 2].topk(2).indices)


def test_the_bias_update_moves_each_expert_towards_the_mean_load() -> None:
    """DeepSeek-V3's step: + rate below the layer's mean load, - rate above it, nothing at it
    (the mean here is 4 tokens: exact, from whole counts); each layer on its own."""
    bias = torch.tensor([[0.5, 0.0, 0.0, -0.1], [0.0, 0.0, 0.0, 0.0]])
    load = torch.tensor([[10, 2, 4, 0], [1, 1, 1, 2]])
    updated = bias_update(bias, load, 0.001)
    expected = torch.tensor([[0.499, 0.001, 0.0, -0.099], [0.001, 0.001, 0.001, -0.001]])
    assert torch.allclose(updated, expected, rtol=0, atol=1e-7)
    assert torch.equal(bias_update(bias, load, 0.0), bias)
    assert torch.equal(bias_update(bias, torch.full((2, 4), 3), 0.001), bias)  # balanced: unmoved


def test_balancing_moves_each_moe_layers_bias_in_place_and_refuses_a_16_bit_one() -> None:
    """The biases of the three MoE layers (the first layer is dense) in layer order; a bf16 bias
    is one line, not a bias whose 0.001 steps round away."""
    config = build_config(model_settings({**named_config("tiny")["model"], **DEEPSEEK}), 512)
    model = AutoModelForCausalLM.from_config(config)
    biases = router_biases(model)
    assert len(biases) == 3 and all(b.dtype == torch.float32 and not b.any() for b in biases)
    load = torch.tensor([[5, 3, 4, 4], [0, 8, 8, 0], [4, 4, 4, 4]])
    balance_routers(model, load, 0.25)
    assert [b.tolist() for b in router_biases(model)] == [
        [-0.25, 0.25, 0.0, 0.0],
        [0.25, -0.25, -0.25, 0.25],
        [0.0] * 4,
    ]
    with pytest.raises(
        StageError,
        match=r"^model\.router_bias_update_rate: 3 routing biases, but loads of 2 MoE layers",
    ):
        balance_routers(model, load[:2], 0.25)
    layer = model.model.layers[1].mlp.gate
    layer.e_score_correction_bias = layer.e_score_correction_bias.bfloat16()
    with pytest.raises(
        StageError,
        match=r"^model\.router_bias_update_rate: model\.layers\.1\.mlp\.gate\.e_score_correction_bias is torch\.bfloat16, not fp32",
    ):
        router_biases(model)


@pytest.mark.parametrize("moe", [MOE, QWEN_MOE], ids=["mixtral", "qwen2_moe"])
def test_the_training_loss_adds_the_architectures_aux_loss(moe: dict[str, Any]) -> None:
    """Both architectures with an aux loss, built from the model section as the stages build
    them: the loss trained on is the language model's plus the coefficient times transformers'
    own aux loss (qwen2_moe's shared expert beside the routed ones), and the router learns."""
    config = build_config(
        model_settings({**named_config("tiny")["model"], **moe, "router_aux_loss_coef": 0.3}), 512
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    routing = routing_of(config)
    assert routing == Routing(experts=4, top_k=2, coef=0.3)
    assert routing_of(LlamaConfig()) is None  # a dense model has no router
    shard = np.random.default_rng(0).integers(0, 512, 400).astype(np.uint16)
    loss, lm, aux, counts = training_loss(
        model, torch.device("cpu"), shard, np.arange(4), 16, routing
    )
    tokens = torch.from_numpy(read_windows(shard, np.arange(4), 16))
    reference = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1], output_router_logits=True)
    assert float(aux) == pytest.approx(float(reference.aux_loss), rel=1e-6)
    assert float(loss) == pytest.approx(float(lm) + 0.3 * float(aux), rel=1e-6)
    layers = config.num_hidden_layers
    assert counts.shape == (layers, 4) and counts.sum(1).tolist() == [4 * 16 * 2] * layers
    loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


class _Engine:
    """What `grpo.steps.train_on` asks of DeepSpeed's engine, on one process: the module's
    forward, backward into its gradients, and a step that leaves them for the test to read."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def named_modules(self) -> Any:
        return self.module.named_modules()

    def modules(self) -> Any:
        return self.module.modules()


@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_grpo_trains_an_moe_policy_on_its_aux_loss_only_when_asked(
    coef: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GRPO stage's own `train_on` on a tiny Mixtral's flat rollouts whose rewards are all
    equal, so the policy gradient is zero: the router learns only from
    `grpo.router_aux_loss_coef` (off by default, as verl and OpenRLHF keep it), whose loss is
    logged; the routing-flip share of the step is measured, and 0 in fp32."""
    monkeypatch.setattr(grpo_steps, "_dp_sums", lambda run, values: list(values))  # one rank
    monkeypatch.setattr(grpo_steps, "_dp_max", lambda run, values: list(values))
    model = tiny_moe("mixtral")
    routing = routing_of(model.config)
    prompts = [[3, 4], [5, 6, 7, 8, 9], [8], [9, 10, 11]]
    with torch.no_grad():
        groups = flat_groups(model, prompts, lambda i, c: 1.0, keys=[("run", i) for i in range(4)], group_size=4,
                             max_new_tokens=6, temperature=0.7, top_p=1.0, eos_id=1, pad_id=0, max_batch=16,
                             routing=routing)  # fmt: skip
    grpo = {"temperature": 0.7, "top_p": 1.0, "passes": 1, "kl_coef": 0.0, "loss_type": "dapo", "clip_eps_low": 0.2,
            "clip_eps_high": 0.28, "max_new_tokens": 6, "sampler_correction": None, "router_aux_loss_coef": coef}  # fmt: skip
    run = SimpleNamespace(cfg=SimpleNamespace(**grpo), engine=_Engine(model), reference=None, routing=routing,
                          tokenizer=SimpleNamespace(pad_token_id=0), device=torch.device("cpu"),
                          layout=SimpleNamespace(grad_accum=2, dp=1, tp=1))  # fmt: skip
    _, logged = grpo_steps.train_on(run, groups)
    router = model.model.layers[0].mlp.gate.weight.grad
    assert logged["moe/routing_flip_share"] == 0.0
    if coef:
        assert router.abs().sum() > 0 and logged["train/aux_loss"] > 0
    else:
        assert router is None or router.abs().sum() == 0
        assert "train/aux_loss" not in logged


def test_a_deepseek_v3_trains_on_the_language_model_loss_and_counts_its_biased_choice() -> None:
    """No aux loss (transformers defines none for it): the loss trained on is the cross-entropy;
    the three MoE layers' counts follow the routing bias (a large one on expert 0 sends every
    token there); the dense first layer routes nothing."""
    config = build_config(model_settings({**named_config("tiny")["model"], **DEEPSEEK}), 512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    routing = routing_of(config)
    assert routing == Routing(experts=4, top_k=2, coef=None, bias_rate=0.001)
    shard = np.random.default_rng(0).integers(0, 512, 400).astype(np.uint16)
    loss, lm, aux, counts = training_loss(
        model, torch.device("cpu"), shard, np.arange(4), 16, routing
    )
    assert aux is None and loss is lm
    assert counts.shape == (3, 4) and counts.sum(1).tolist() == [4 * 16 * 2] * 3
    for bias in router_biases(model):
        bias[0] = 5.0
    _, _, _, counts = training_loss(model, torch.device("cpu"), shard, np.arange(4), 16, routing)
    assert counts[:, 0].tolist() == [4 * 16] * 3


STEPS = 100
COEF = 0.1
"""The aux loss's weight in the balanced runs: the architectures' default (0.001) moves a tiny
router too little in 100 steps to tell from noise."""
RATE = 0.01
"""The routing bias's step in deepseek_v3's balanced run, ten times DeepSeek-V3's (the default),
as COEF is for the aux loss: at 0.001 the bias can move 0.1 in 100 steps, and the second
half's imbalance measured 1.45 against 1.54 at rate 0, inside this test's 5% margin of noise."""
BALANCING = {
    "mixtral": (MOE, "router_aux_loss_coef", COEF),
    "deepseek_v3": (DEEPSEEK, "router_bias_update_rate", RATE),
}
"""Each way of balancing a router: a tiny model that uses it, its key, and the balanced value.
qwen2_moe balances by the same aux loss as mixtral, through the same code; its loss is held to
transformers' own in test_the_training_loss_adds_the_architectures_aux_loss."""


def _imbalance(
    data: dict[str, str], out: Path, model: dict[str, Any], key: str, value: float
) -> dict[str, Any]:
    config = model_config(out / "model", **model, **{key: value})
    summary = run(data, out, world=2, layout=dp2(2), model_config=config,
                  config_changes={"pretrain": {"steps": STEPS, "checkpoint_every": STEPS, "eval_every": STEPS,
                                               "log_every": 10}})  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    aux = key == "router_aux_loss_coef"  # deepseek_v3 has no aux loss to log
    assert all(("train/aux_loss" in r) == aux and "moe/load_by_layer" in r for r in records)
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("architecture", list(BALANCING))
def test_the_aux_loss_balances_the_experts_on_two_ranks(
    data: dict[str, str], tmp_path: Path, architecture: str
) -> None:
    """For deepseek_v3 the balancing is the routing bias's update, against a rate of 0."""
    model, key, value = BALANCING[architecture]
    balanced = _imbalance(data, tmp_path / "aux", model, key, value)
    free = _imbalance(data, tmp_path / "none", model, key, 0.0)
    b, f = balanced["experts"], free["experts"]
    setting = "aux_loss_coef" if key == "router_aux_loss_coef" else "bias_update_rate"
    assert b[setting] == value and f[setting] == 0.0
    # One step routes only 512 token slots, so one record's imbalance is noisy (a balanced
    # router would read about 1.1): the second half's records are compared. Measured: mixtral
    # 1.46 against 1.73, deepseek_v3 1.19 against 1.54 (qwen2_moe, when it ran here: 1.31 against 1.53).
    late = {name: np.mean([v for step, v in s["load_max_over_mean"].items() if int(step) > STEPS // 2])
            for name, s in (("balanced", b), ("free", f))}  # fmt: skip
    assert late["balanced"] < 0.95 * late["free"], (late, b, f)
    if setting == "aux_loss_coef":
        assert b["final_aux_loss"] < f["final_aux_loss"], (b, f)
    else:
        assert b["final_aux_loss"] is None and b["aux_loss_coef"] is None
    assert (tmp_path / "aux" / "loss.png").stat().st_size > 0


def _biases(folder: Path, tag: str, zero: int) -> dict[str, torch.Tensor]:
    """The routing biases rank 0's model-states file of `tag` holds (a buffer is saved whole)."""
    name = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero == 3 else "mp_rank_00_model_states.pt"
    )
    module = load_file(folder / tag / name)["module"]
    return {k: v for k, v in module.items() if k.endswith(BIAS)}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_a_deepseek_v3_routing_bias_survives_resume_and_consolidation(data: dict[str, str], tmp_path: Path,
                                                                      zero: int) -> None:  # fmt: skip
    """The bias is a buffer: DeepSpeed's model-states file keeps it (ZeRO-2 and ZeRO-3), in fp32.
    A run resumed from step 2 ends with the bias of the uninterrupted run (one restarted at zero
    would be two updates behind) and, under ZeRO-2, the same checksum, biases included, on both
    ranks; under ZeRO-3 so does a resume from step 2 on one rank, through DeepSpeed's universal
    checkpoint, which restores parameters alone (the stage copies the buffers back). The bf16 folder consolidated from it holds the bias exactly (written in fp32, as
    transformers keeps it), and loads and generates in transformers; under ZeRO-3 GRPO trains
    from it, every parameter partitioned (the KL term's reference too), and measures how often
    its trainer routes a sampled token otherwise."""
    config = model_config(tmp_path / "model", **DEEPSEEK)
    layout, every2 = dp2(zero), {"pretrain": {"checkpoint_every": 2}}
    first = run(data, tmp_path, world=2, layout=layout, model_config=config, config_changes=every2)
    assert (
        first["experts"]["bias_update_rate"] == 0.001 and first["experts"]["final_aux_loss"] is None
    )
    folder = Path(first["checkpoint"]["folder"])
    straight, early = _biases(folder, "step00000004", zero), _biases(folder, "step00000002", zero)
    assert len(straight) == 3 and all(
        b.dtype == torch.float32 and b.any() for b in straight.values()
    )
    assert all(not torch.equal(straight[k], early[k]) for k in straight)
    truncate(folder / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    proc = launch(
        data, tmp_path, world=2, layout=layout, model_config=config, config_changes=every2
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["resumed_from_step"] == 2 and again["losses"] == first["losses"]
    resumed = _biases(folder, "step00000004", zero)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight), (resumed, straight)
    if zero < 3:
        assert again["param_checksum_per_rank"][0] == again["param_checksum_per_rank"][1]
    else:  # and on one rank: DeepSpeed's universal checkpoint restores parameters alone
        truncate(folder / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        one = launch(data, tmp_path, world=1, layout={**layout, "dp": 1}, model_config=config,
                     config_changes=every2)  # fmt: skip
        assert one.returncode == 0, one.stderr[-4000:]
        again = json.loads((tmp_path / "summary.json").read_text())
        assert again["resumed_from_step"] == 2 and again["layout"]["world"] == 1
        assert "converted step 2" in one.stdout + one.stderr
        resumed = _biases(folder, "step00000004", zero)
        # A bias restarted at zero would be two updates (0.002) short.
        assert all(torch.allclose(resumed[k], straight[k], atol=1e-6) for k in straight), resumed
    (tmp_path / "run-summary.json").write_text(json.dumps(again))
    manifest = consolidate(stage="pretrain", summary_path=str(tmp_path / "run-summary.json"),
                           tokenizer_dir=data["tokenizer"], model_config_path=config, meta_path=data["meta"],
                           out=str(tmp_path / "hf"), cfg=ConsolidateSettings(dtype="bf16", max_shard_size="2GB",
                                                                             verify="loss"))  # fmt: skip
    assert manifest["verification"]["method"] == "loss"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    for name, value in straight.items():
        assert model.get_buffer(name).dtype == torch.float32 and torch.equal(
            model.get_buffer(name), value
        ), name
    generated = model.generate(torch.tensor([[5, 9, 13]]), max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, 9)
    if zero == 3:  # GRPO from the folder, every parameter partitioned
        cfg = grpo_config()
        grpo = run_grpo({**data, "model_config": config}, str(tmp_path / "hf"), tmp_path / "grpo",
                        world=2, layout=layout, cfg=cfg, partition_all=True)  # fmt: skip
        assert grpo["optimizer_steps"] == cfg["grpo"]["steps"]
        flips = grpo["sampler"][
            "routing_flip_share_max"
        ]  # fp32: the sampler and trainer route alike
        assert flips is not None and flips <= 0.01, grpo["sampler"]


def _resumed_on(data: dict[str, str], out: Path, first: PretrainSummary, world: int,
                layout: dict[str, Any], **kwargs: Any) -> tuple[PretrainSummary, str]:  # fmt: skip
    """`first` run again from its step-2 checkpoint (its last made unreadable) on `world` ranks
    under `layout`: the summary, and the log."""
    folder = Path(first["checkpoint"]["folder"])
    truncate(sorted((folder / "step00000004").glob("*optim_states.pt"))[-1])
    proc = launch(data, out, world=world, layout=layout, **kwargs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.slow
def test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep(
    data: dict[str, str], tmp_path: Path
) -> None:
    """A deepseek_v3 on 2 ranks at ep=2 (DeepSpeed AutoEP: each rank 2 of every layer's 4 routed
    experts; ZeRO-2) trains as 1 rank without AutoEP does on the same global batch: the same
    losses (fp32), expert loads and routing biases. Its checkpoint (AutoEP's per-expert files)
    consolidates into a folder that loads and generates in transformers, and a missing expert
    file is refused in one line. Elastic, each run resumed from step 2 ends as it would have:
    the ep=2 run at ep=2 under ZeRO-3 (two optimizer sub-groups, which DeepSpeed's loader gave
    one step counter); the 1-rank run at ep=2 (its one optimizer group given to AutoEP's two).
    The ep=2 run resumed on 1 rank is the elastic chain's MoE leg (test_elastic.py). GRPO from
    the folder trains at ep=2 as on 1 rank (`_grpo_at_ep_2_as_on_one_rank`)."""
    config = model_config(tmp_path / "model", **DEEPSEEK)
    changes = {"model": DEEPSEEK, "pretrain": {"checkpoint_every": 2}}
    kwargs = {"model_config": config, "config_changes": changes}
    one = {"dp": 1, "tp": 1, "micro_batch_size": 2, "zero_stage": 2}
    ep2 = {"dp": 2, "tp": 1, "ep": 2, "micro_batch_size": 2, "zero_stage": 2}
    single = run(data, tmp_path / "one", world=1, layout=one, **kwargs)
    split = run(data, tmp_path / "ep2", world=2, layout=ep2, **kwargs)
    assert split["layout"]["ep"] == 2 and single["layout"]["ep"] == 1
    for step, loss in single["losses"].items():
        assert abs(split["losses"][step] - loss) <= 1e-5 * loss, (split["losses"], single["losses"])
    assert split["experts"]["final_load_by_layer"] == single["experts"]["final_load_by_layer"]
    folder = Path(split["checkpoint"]["folder"])
    biases = _biases(folder, "step00000004", 2)
    assert sorted(biases) == [f"model.layers.{i}.mlp.router.{BIAS}" for i in (1, 2, 3)]
    reference = _biases(Path(single["checkpoint"]["folder"]), "step00000004", 2)
    assert any(b.any() for b in biases.values()) and all(
        torch.allclose(b, reference[k.replace("router.", "gate.")], atol=1e-7) for k, b in biases.items()
    )  # fmt: skip

    (tmp_path / "split.json").write_text(json.dumps(split))
    cfg = ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss")
    arguments = dict(stage="pretrain", summary_path=str(tmp_path / "split.json"), tokenizer_dir=data["tokenizer"],
                     model_config_path=config, meta_path=data["meta"], cfg=cfg)  # fmt: skip
    assert consolidate(**arguments, out=str(tmp_path / "hf"))["verification"]["method"] == "loss"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 128, 128)
    assert model.generate(torch.tensor([[5, 9, 13]]), max_new_tokens=6, do_sample=False).shape == (
        1,
        9,
    )
    expert = folder / "step00000004" / "layer_2_expert_3_mp_rank_00_model_states.pt"
    saved = expert.read_bytes()
    expert.unlink()
    with pytest.raises(StageError, match=r"layer_2_expert_3_mp_rank_00_model_states\.pt: missing from the checkpoint \(step00000004 of a dp=2 tp=1 ep=2 ZeRO-2 run\)$"):  # fmt: skip
        consolidate(**arguments, out=str(tmp_path / "hf2"))
    expert.write_bytes(saved)

    layout = {**ep2, "zero_stage": 3}
    again, log = _resumed_on(data, tmp_path / "ep2", split, 2, layout, **kwargs)
    assert again["resumed_from_step"] == 2 and again["layout"]["world"] == 2
    assert f"(dp=2 tp=1 ep=2) ZeRO-2 -> {reshard.describe(layout)}: converted step 2" in log
    assert again["losses"] == split["losses"]
    up, log = _resumed_on(data, tmp_path / "one", single, 2, ep2, **kwargs)
    assert up["resumed_from_step"] == 2 and up["layout"]["ep"] == 2
    assert "step00000002.autoep.universal" in log
    # 2 ranks at ep=2 from step 2 against 1 rank's own steps 3-4: as close as the runs above (on
    # a Sapphire Rapids step 3 came out 5e-7 apart, on an EPYC equal).
    assert up["losses"].keys() == single["losses"].keys()
    for step, loss in single["losses"].items():
        assert abs(up["losses"][step] - loss) <= 1e-5 * loss, (up["losses"], single["losses"])
    _grpo_at_ep_2_as_on_one_rank(data, config, tmp_path / "hf", tmp_path / "grpo")


@pytest.mark.slow
@pytest.mark.parametrize("moe", [MOE, QWEN_MOE], ids=["mixtral", "qwen2_moe"])
def test_an_aux_loss_moe_at_ep_2_trains_as_one_rank_does_its_aux_loss_included(
    moe: dict[str, Any], data: dict[str, str], tmp_path: Path
) -> None:
    """A Mixtral, and a qwen2_moe (through qwen3_moe's preset, its gated shared expert whole on
    every rank), through AutoEP (transformers' output-capture registry lent in the form
    DeepSpeed 0.19.8 edits: `training.autoep.keyed_output_registry`) on 2 ranks at ep=2 train as
    1 rank without AutoEP does: the same losses (fp32) and expert loads, and the same
    load-balancing loss, read from AutoEP's router as from transformers' (coefficient 0.1, so
    that it moves the weights). The checkpoint consolidates into a folder that loads and
    generates. (GRPO at ep=2 is the deepseek_v3 test's, whose router returns no logits.)"""
    model = {**moe, "router_aux_loss_coef": 0.1}
    config = model_config(tmp_path / "model", **model)
    kwargs = {"model_config": config, "config_changes": {"model": model}}
    layout = {"dp": 1, "tp": 1, "micro_batch_size": 2, "zero_stage": 2}
    single = run(data, tmp_path / "one", world=1, layout=layout, **kwargs)
    split = run(data, tmp_path / "ep2", world=2, layout={**layout, "dp": 2, "ep": 2}, **kwargs)
    assert split["layout"]["ep"] == 2
    for step, loss in single["losses"].items():
        assert abs(split["losses"][step] - loss) <= 1e-5 * loss, (split["losses"], single["losses"])
    ours, theirs = split["experts"], single["experts"]
    assert ours["final_load_by_layer"] == theirs["final_load_by_layer"]
    assert theirs["final_aux_loss"] > 0
    assert ours["final_aux_loss"] == pytest.approx(theirs["final_aux_loss"], rel=1e-5)
    (tmp_path / "split.json").write_text(json.dumps(split))
    consolidate(stage="pretrain", summary_path=str(tmp_path / "split.json"), tokenizer_dir=data["tokenizer"],
                model_config_path=config, meta_path=data["meta"], out=str(tmp_path / "hf"),
                cfg=ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss"))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.generate(torch.tensor([[5, 9, 13]]), max_new_tokens=6, do_sample=False).shape == (
        1,
        9,
    )


def _grpo_at_ep_2_as_on_one_rank(data: dict[str, str], config: str, start: Path, out: Path) -> None:
    """GRPO from the deepseek_v3 folder `start` at ep=2 under ZeRO-3, every parameter partitioned
    (its KL reference without AutoEP), as on 1 rank, on a reward that varies within every group.
    Each generate call is a collective under ep, so the calls run in lockstep; the held-out
    problems (12 of each of three families, in chunks of 4) make 9 chunks, so one rank scores a
    spare one. The routing that AutoEP's routers chose (deepseek_v3's router returns no logits
    under AutoEP) is what the sampler recorded; both checkpoints consolidate to the same weights,
    and the ep=2 run resumed on 1 rank from its step-2 checkpoint ends as the 1-rank run."""
    out.mkdir()
    cfg = merge(grpo_config(eval_problems=12, checkpoint_every=1, curriculum={"families": ["sums"]}),
                {"model": DEEPSEEK, "tasks": _varied_rewards(out)})  # fmt: skip
    layout = {"dp": 1, "tp": 1, "micro_batch_size": 2, "zero_stage": 2}
    grpo = {name: run_grpo({**data, "model_config": config}, str(start), out / name, world=world,
                           layout={**layout, **extra}, cfg=cfg, generation_batch=4, partition_all=world > 1)
            for name, world, extra in (("grpo1", 1, {}), ("grpo_ep2", 2, {"dp": 2, "ep": 2, "zero_stage": 3}))}  # fmt: skip
    assert (grpo["grpo_ep2"]["layout"]["ep"], grpo["grpo1"]["layout"]["ep"]) == (2, 1)
    assert len(grpo["grpo1"]["accuracy"]["end_by_family"]) == 3  # 36 problems: 9 chunks of 4
    one, ep2 = (metric_records(out / name) for name in ("grpo1", "grpo_ep2"))
    assert_learning_signal(out / "grpo1" / "metrics.jsonl")
    assert [r["rollout/lockstep_generate_calls"] for r in ep2[1:]] == [2, 2, 2]
    assert [r["rollout/lockstep_generate_calls"] for r in one[1:]] == [0, 0, 0]
    for a, b in zip(one[1:], ep2[1:], strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["moe/routing_flip_share"] == b["moe/routing_flip_share"] == 0.0
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-9)
    assert grpo["grpo_ep2"]["accuracy"] == grpo["grpo1"]["accuracy"]
    weights = []
    for name in grpo:
        consolidate(stage="grpo", summary_path=str(out / name / "summary.json"), tokenizer_dir=data["tokenizer"],
                    model_config_path=config, meta_path=data["meta"], out=str(out / f"{name}-hf"),
                    cfg=ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss"))  # fmt: skip
        (file,) = (out / f"{name}-hf").glob("*.safetensors")
        weights.append(safetensors.torch.load_file(file))
    assert weights[0].keys() == weights[1].keys()
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < PARAM_ATOL
    # Elastic: the ep=2 run, its last checkpoint made unreadable, resumes on 1 rank without AutoEP.
    folder = Path(grpo["grpo_ep2"]["checkpoint"]["folder"])
    truncate(sorted((folder / "step00000003").glob("*optim_states.pt"))[-1])
    proc = launch_grpo({**data, "model_config": config}, str(start), out / "grpo_ep2", world=1, layout=layout,
                       cfg=cfg, generation_batch=4)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = "2 ranks (dp=2 tp=1 ep=2) ZeRO-3 -> 1 rank (dp=1 tp=1) ZeRO-2: converted step 2"
    assert line in proc.stdout + proc.stderr
    again = json.loads((out / "grpo_ep2" / "summary.json").read_text())
    assert again["resumed_from_step"] == 2 and again["layout"]["ep"] == 1
    assert again["rewards"] == grpo["grpo1"]["rewards"]
    assert again["losses"] == pytest.approx(grpo["grpo1"]["losses"], rel=1e-4, abs=1e-9)


REWARD = '''
def odd(prompts, completions, **kw):
    """1 where the completion's characters sum to an odd number: a reward that varies within a
    group of any sampling policy, trained or not, so that its advantages are not all zero."""
    return [float(sum(map(ord, c)) % 2) for c in completions]
'''


def _varied_rewards(root: Path) -> dict[str, Any]:
    """A tasks section of one family of the user's own, "sums", rewarded by `REWARD`."""
    rows = [
        {"question": f"{i} + {i % 7} =", "solution": str(i + i % 7), "level": 1} for i in range(400)
    ]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARD)
    return validate_section("tasks", {"families": [{
        "name": "sums", "files": [str(root / "sums.jsonl")], "columns": {"prompt": "question", "answer": "solution", "level": "level"},
        "rewards": [{"function": f"{root / 'rewards.py'}:odd"}],
    }]})  # fmt: skip


def test_an_aux_loss_coefficient_on_a_dense_model_is_one_line() -> None:
    model = {**named_config("tiny")["model"], "router_aux_loss_coef": 0.01}
    with pytest.raises(
        StageError, match=r"^model\.router_aux_loss_coef: not used by architecture 'llama'"
    ):
        build_config(model_settings(model), 512)
    moe = build_config(model_settings({**model, **MOE}), 512)
    assert moe.router_aux_loss_coef == 0.01
