"""What one GRPO run holds while it trains: `Run`, built once by `grpo.train.setup` and read by
every step (`grpo.steps`), the replay it mixes in, and its checkpoints' client state
(summary.json's type is `grpo.summary`'s). Its own module so that the loop and the steps
both import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import HfDeepSpeedConfig

from stagetrain.config.settings import CurriculumSettings, GrpoSettings
from stagetrain.grpo.curriculum import CurriculumStateRecord
from stagetrain.grpo.metrics import GrpoRecord
from stagetrain.grpo.tree import TreeConfig
from stagetrain.planning.plan import Layout
from stagetrain.tasks import Problem
from stagetrain.tasks.judge import Judge
from stagetrain.training.checkpoints import ClientState
from stagetrain.training.experts import Routing
from stagetrain.training.loop import StageLoop
from stagetrain.training.spec import GrpoJob

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class Replay(NamedTuple):
    """What `grpo.replay` mixes into each step: `share` of the prompts from `families`, each
    at a level drawn uniformly from 1 to its `levels` (the corpus's levels of it)."""

    share: float
    levels: dict[str, int]


class GrpoClient(ClientState):
    """What GRPO's checkpoints carry beside DeepSpeed's state: every family's curriculum."""

    curriculum: dict[str, CurriculumStateRecord]


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once by `setup`."""

    spec: GrpoJob
    cfg: GrpoSettings
    engine: DeepSpeedEngine
    reference: DeepSpeedEngine | PreTrainedModel | None
    """The frozen reference policy; None without a KL term."""
    tokenizer: PreTrainedTokenizerBase
    judge: Judge
    """The prompts and rewards of the task families (training and evaluation alike)."""
    device: torch.device
    layout: Layout
    dp_rank: int
    curriculum: CurriculumSettings
    tree: TreeConfig | None
    eval_set: list[Problem]
    loop: StageLoop[GrpoRecord, GrpoClient]
    val: np.ndarray
    eval_windows: np.ndarray
    generation_batch: int
    """Most sequences one `generate` call makes: the plan counted their KV cache."""
    gather_whole: bool = True
    """Whether generation gathers the whole policy on every rank under ZeRO-3 (the plan's
    `generation.gather`: "whole", or "per_token" where the gathered copy does not fit)."""
    routing: Routing | None = None
    """An MoE policy's routing (`training.experts.routing_of`); None for a dense one."""
    replay: Replay | None = None
    zero3_config: HfDeepSpeedConfig | None = None
    """Held for the run's life under ZeRO-3: transformers keeps only a weak reference to it."""
