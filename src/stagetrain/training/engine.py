"""Building the model and the DeepSpeed engine, in the order that keeps every rank's memory small.

1. Under ZeRO-3 an `HfDeepSpeedConfig` is kept alive first: transformers then
   constructs (or loads) the model inside `deepspeed.zero.Init`, so each rank
   holds only its partition from the start, never the whole model. A model
   loaded from a folder is loaded in fp32, whatever dtype it was saved in
   (consolidation writes bf16): DeepSpeed casts the module to a 16-bit plan's
   precision and keeps fp32 master weights, but under an fp32 plan it casts
   nothing, so a bf16 folder loaded as stored would train in pure bf16. A
   from-scratch model is then initialised parameter by parameter from
   generators seeded by the parameter's name (`init_weights`), so the initial
   weights are the same whatever the ZeRO stage, tp or world size; transformers'
   own initialisation consumes the random stream differently under zero.Init.
2. The embeddings are resized to model_config.json's padded vocabulary
   (stagetrain.model.embeddings), before the engine exists.
3. MoE sparse blocks become ZeRO-3 leaf modules, so a rank whose tokens skip an
   expert does not wait forever for that expert's parameters. Under expert parallelism
   AutoEP replaces those blocks, and its layer runs every local expert's weights at once.
4. Activation checkpointing follows the plan.
5. `deepspeed.initialize` wraps it; AutoTP splits it when the config asks for tp > 1, and
   AutoEP shares out its routed experts when it asks for ep > 1 (each rank keeps 1/ep of
   them, under AutoEP's own names: `training.experts`, `consolidate.experts`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from safetensors import SafetensorError, safe_open
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations import HfDeepSpeedConfig

from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.errors import StageError
from stagetrain.io import read_json
from stagetrain.model.embeddings import resize_embeddings
from stagetrain.planning.plan import PlanPart
from stagetrain.training.autoep import keyed_output_registry
from stagetrain.training.deepspeed_config import DeepSpeedJson

if TYPE_CHECKING:
    from stagetrain.training.spec import JobSpec

SPARSE_BLOCKS = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
}


COLLECTIVE_TIMEOUT_S = 600
"""How long a rank waits in one collective (and at the start-up barrier) for the
others before it fails, unless STAGETRAIN_COLLECTIVE_TIMEOUT_S says otherwise.
A peer whose process died closes its connections and fails the others at once;
this bounds the case where nothing closes them (a node whose link went down, a
rank hung in a kernel): without it gloo and DeepSpeed wait 30 minutes. 10 minutes
covers the longest barrier of training, the one after every rank's checkpoint save;
the wait for a checkpoint's conversion at resume has a group and timeout of its own
(training/checkpoints.py, RESUME_DECISION_TIMEOUT)."""


def collective_timeout(env: Mapping[str, str]) -> timedelta:
    """The collective timeout from STAGETRAIN_COLLECTIVE_TIMEOUT_S, else COLLECTIVE_TIMEOUT_S."""
    raw = env.get("STAGETRAIN_COLLECTIVE_TIMEOUT_S", str(COLLECTIVE_TIMEOUT_S))
    if not raw.isdigit() or int(raw) == 0:
        raise StageError(
            f"STAGETRAIN_COLLECTIVE_TIMEOUT_S: expected a whole number of seconds > 0, got {raw!r}"
        )
    return timedelta(seconds=int(raw))


def bound_every_group(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group made after this, not only the world's.

    DeepSpeed reduces gradients on groups of its own (`torch.distributed.new_group`, no
    timeout given), which take torch's module default, 30 minutes, not the timeout the world
    was started with: with a link down, a rank waited in the gradient all-reduce past any
    bound of ours. torch has no public setter; these two module defaults are what `new_group`
    reads (`distributed_c10d._get_default_timeout`).
    """
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if isinstance(distributed_c10d.default_pg_nccl_timeout, timedelta):
        distributed_c10d.default_pg_nccl_timeout = timeout


def skip_inference_comm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce when a rank joins.

    DeepSpeed's torch backend builds that op (a JIT C++ compile with g++: 43 s on a quiet 2-core
    CPU, minutes under load, cached per environment) as it starts, for `inference_all_reduce` alone:
    DeepSpeed-Inference's layers, and AutoTP's forward in eval mode. Training never calls it,
    and without the op that all-reduce falls back to the process group's, the same sum.
    DeepSpeed reads the op's availability from `deepspeed.ops.__compatible_ops__`, a dict it
    makes on first read and keeps so that edits to it hold. Making it probes every op DeepSpeed
    has (a g++ compile and link for async I/O, package-manager queries: 0.12-0.16 s a rank), and
    this op's check is its one reader; so the rank makes the dict itself, the probe never runs,
    and every op reads as not there (DeepSpeed's `.get(name, False)`).
    """
    import deepspeed.ops

    compatible = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
    compatible["deepspeed_shm_comm"] = False


def join_world(spec: JobSpec) -> tuple[PlanPart, TokenizerMeta, DeepSpeedJson, torch.device]:
    """Start this rank's process group and check the world against the plan.

    Returns the stage's part of the plan, meta.json, the DeepSpeed config and this rank's
    device; the same start for every training stage.
    """
    plan: PlanPart = read_json(spec["plan"])
    meta: TokenizerMeta = read_json(spec["meta"])
    ds_config: DeepSpeedJson = read_json(spec["deepspeed_config"])
    timeout = collective_timeout(os.environ)
    bound_every_group(timeout)
    skip_inference_comm_op()
    deepspeed.init_distributed(dist_backend=plan["backend"], timeout=timeout)
    world = torch.distributed.get_world_size()
    if world != plan["world"]:
        raise StageError(f"plan.json: world size {plan['world']}, but {world} processes started")
    return plan, meta, ds_config, _device(plan["backend"])


def _device(backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.device_count() <= local:
        raise StageError(
            f"rank with LOCAL_RANK={local} has no GPU (this node shows {torch.cuda.device_count()})"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def load_model_config(path: str | Path) -> PretrainedConfig:
    """model_config.json back into its transformers config class."""
    raw = json.loads(Path(path).read_text())
    return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") >> 1


def init_weights(model: torch.nn.Module, *, seed: int, std: float) -> None:
    """Llama-style initialisation (transformers' scheme: normal(0, std) for matrices and
    embeddings, ones for norm weights, zeros for biases), one seeded generator per parameter."""
    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if len(shape) == 1:
            value = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        else:
            value = torch.empty(shape).normal_(
                0.0, std, generator=torch.Generator().manual_seed(_name_seed(seed, name))
            )
        gather = (
            deepspeed.zero.GatheredParameters([param], modifier_rank=0)
            if hasattr(param, "ds_id")
            else nullcontext()
        )
        with gather, torch.no_grad():
            param.copy_(value.to(param.dtype))


def local_elements(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, elements of the whole model), ZeRO-3 aware."""
    local = sum(
        p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters()
    )
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return local, total


def load_pretrained(folder: str) -> PreTrainedModel:
    """The model of `folder` (model.init_from, or the consolidated model GRPO starts from), in
    fp32, refused in one line when its weights do not match its config.json: transformers
    only warns, and leaves a missing tensor (a fifth layer of a four-layer file) random. A
    damaged weight file, or a pickle that would run code, is refused in one line naming it."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:  # safe_open parses the header: a cut file is "not fully covered"
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as err:
            raise StageError(
                f"model.init_from: {path}: does not read as safetensors ({err}): truncated or "
                "damaged; copy it again"
            ) from None
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            trust_remote_code=False,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in the loading info, refused below in one line
        )
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: (GLOBAL \S+)", str(err))
        raise StageError(
            f"model.init_from: {folder}: a .bin weight file was refused: loading it would run "
            f"code ({refused.group(1) if refused else 'not plain tensors'}), and weights are only "
            "loaded as plain tensors; save the model as safetensors from a copy you trust"
        ) from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(k[0] if isinstance(k, tuple) else k for k in info.get(kind) or ())
        if keys:
            raise StageError(
                f"model.init_from: {folder}: {len(keys)} {kind.replace('_keys', '')} weight(s) against "
                f"its config.json, the first {keys[0]!r}: the folder's weights and config do not match"
            )
    return model


class ParamCounts(TypedDict):
    """The model's parameter elements after construction: this rank's (about 1/dp of them under
    ZeRO-3) and the whole model's."""

    local_param_elements: int
    param_elements: int


def build(
    *,
    config: PretrainedConfig,
    ds_config: DeepSpeedJson,
    init_from: str | None,
    activation_checkpointing: bool,
    seed: int,
    attention: str,
) -> tuple[DeepSpeedEngine, ParamCounts, HfDeepSpeedConfig | None]:
    """The DeepSpeed engine, this rank's parameter count after construction, and the HF hook to
    keep alive. `attention` is the plan's kernel (`planning.attention`)."""
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    hook = HfDeepSpeedConfig(dict(ds_config)) if zero3 else None
    torch.manual_seed(seed)
    if init_from:
        model = load_pretrained(init_from)
    else:
        model = AutoModelForCausalLM.from_config(config)
        init_weights(model, seed=seed, std=config.initializer_range)
    model.set_attn_implementation(attention)
    local, total = local_elements(model)
    resize_embeddings(model, config.vocab_size, seed=seed)
    if zero3 and config.model_type in SPARSE_BLOCKS and "expert_parallel" not in ds_config:
        module, name = SPARSE_BLOCKS[config.model_type]
        block = getattr(__import__(module, fromlist=[name]), name)
        deepspeed.utils.set_z3_leaf_modules(model, [block])
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    with keyed_output_registry() if "expert_parallel" in ds_config else nullcontext():
        engine, *_ = deepspeed.initialize(
            model=model,
            config=dict(ds_config),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
        )
    counts: ParamCounts = {"local_param_elements": local, "param_elements": total}
    return engine, counts, hook


def dtypes(engine: DeepSpeedEngine) -> dict[str, str]:
    """The dtype of the module's parameters and of the optimizer's (master) parameters and states.

    The optimizer DeepSpeed wraps (bf16/fp16 and ZeRO optimizers keep fp32
    master copies) is reached through `.optimizer`; with ZeRO 0 in fp32 it is
    torch's AdamW itself.
    """
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    master = {str(p.dtype) for group in inner.param_groups for p in group["params"]}
    states = {str(t.dtype) for state in inner.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim() > 0}  # fmt: skip
    module = {str(getattr(p, "ds_tensor", p).dtype) for p in engine.module.parameters()}
    return {
        "parameters": ",".join(sorted(module)),
        "master": ",".join(sorted(master)),
        "optimizer_states": ",".join(sorted(states)) or "none (no optimizer step yet)",
    }


@contextlib.contextmanager
def gathered(engine: DeepSpeedEngine, *, whole: bool = True) -> Iterator[None]:
    """Under ZeRO-3, the whole policy gathered on every rank, and ZeRO-3's module hooks off, for a
    generation phase; nothing otherwise, or where the plan found no room for the gathered copy
    (`whole` False: its `generation.gather` is "per_token", and each forward gathers a layer at
    a time, the ranks in lockstep: `training.evaluation.in_lockstep`).

    Ranks generate different numbers of tokens (their own prompts, early stops,
    tree searches of different shapes); with ZeRO-3's hooks on, each forward
    would all-gather parameters and ranks that stop early would leave the others
    waiting. TRL's `unwrap_model_for_generation` does the same: gather, remove
    the hooks, generate, put the hooks back. Cost: one full 16-bit copy of the
    model on every rank while it lasts (under AutoEP, with the rank's share of the experts).
    """
    if engine.zero_optimization_stage() != 3 or not whole:
        yield
        return
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        for param in engine.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)
