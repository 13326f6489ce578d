"""One GRPO update through the stage's own `grpo.steps.train_on`, started by tests/test_grpo_math.py.

Usage: torchrun --standalone --nproc_per_node DP tests/dist/grpo_normaliser.py OUT_DIR GRAD_ACCUM

Every rank builds the same tiny Llama, wraps it with deepspeed.initialize (ZeRO-0, fp32,
GRAD_ACCUM micro batches, plain SGD at lr 1 as the client optimizer, so the update is minus the
gradient itself: Adam would hide its scale) and takes its contiguous share of one fixed global
batch of groups, whose completions differ in length and of which some have no reward variance
(so the micro batches' shares of the normaliser differ). After `train_on` rank 0 writes the
weights to OUT_DIR/weights.pt. 2 ranks x 2 micro batches and 1 rank x 3 must end equal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from stagetrain.config.settings import GrpoSettings
from stagetrain.grpo.rollouts import Group
from stagetrain.grpo.steps import train_on
from stagetrain.training.engine import skip_inference_comm_op

GROUPS = 6
"""Groups of two completions in the global batch (3 per rank at dp 2)."""


def groups() -> list[Group]:
    """The global batch: completions of 1-5 tokens; every third group's rewards are equal."""
    out = []
    for g in range(GROUPS):
        rewards = [1.0, 1.0] if g % 3 == 2 else [1.0, 0.0]
        completions = [[5 + g, 6, 7][: 1 + g % 3], [9, 10, 11, 12, 13][: 2 + g % 4]]
        adv = [1.0, -1.0] if rewards[0] != rewards[1] else [0.0, 0.0]
        out.append(Group(prompt=[3, 4 + g], completions=completions, rewards=rewards,
                         advantages=[torch.full((len(c),), a) for c, a in zip(completions, adv, strict=True)],
                         generated_tokens=0, flat_tokens=0, nodes=2,
                         sampler_logprobs=[[float("nan")] * len(c) for c in completions]))  # fmt: skip
    return out


def main(out: Path, grad_accum: int) -> None:
    skip_inference_comm_op()  # as the stages do
    deepspeed.init_distributed(dist_backend="gloo")
    dp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": grad_accum,
          "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds
    )
    grpo = {"temperature": 0.7, "top_p": 1.0, "passes": 1, "kl_coef": 0.0, "loss_type": "dapo",
            "clip_eps_low": 0.2, "clip_eps_high": 0.28, "max_new_tokens": 8, "sampler_correction": None, "router_aux_loss_coef": 0.0}  # fmt: skip
    cfg = SimpleNamespace(**grpo)
    assert set(grpo) <= {f for f in GrpoSettings.__dataclass_fields__}
    run = SimpleNamespace(cfg=cfg, engine=engine, reference=None, routing=None, tokenizer=SimpleNamespace(pad_token_id=0),
                          device=torch.device("cpu"), layout=SimpleNamespace(grad_accum=grad_accum, dp=dp, tp=1))  # fmt: skip
    share = GROUPS // dp
    train_on(run, groups()[rank * share : (rank + 1) * share])
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            out / "weights.pt",
        )
    # Both ranks leave together, through the process group's own teardown: a rank that exited
    # while the other still saved took gloo's threads down with it (SIGABRT, "terminate called
    # without an active exception"), once in a loaded full suite.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
