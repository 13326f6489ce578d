"""What one GRPO run holds while it trains: `Run`, built once by `grpo.train.setup` and read by
every step (`grpo.steps`), and the replay it mixes in. Its own module so that the loop and the
steps both import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers.integrations import HfDeepSpeedConfig

from stagetrain.grpo.curriculum import CurriculumConfig
from stagetrain.grpo.tree import TreeConfig
from stagetrain.planning.plan import Layout
from stagetrain.settings import GrpoSettings
from stagetrain.tasks import Problem
from stagetrain.tasks.judge import Judge
from stagetrain.training.loop import StageLoop


class Replay(NamedTuple):
    """What `grpo.replay` mixes into each step: `share` of the prompts from `families`, each
    at a level drawn uniformly from 1 to its `levels` (the corpus's levels of it)."""

    share: float
    levels: dict[str, int]


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once by `setup`."""

    spec: dict[str, Any]
    cfg: GrpoSettings
    engine: Any
    reference: Any
    tokenizer: Any
    judge: Judge
    """The prompts and rewards of the task families (training and evaluation alike)."""
    device: torch.device
    layout: Layout
    dp_rank: int
    curriculum: CurriculumConfig
    tree: TreeConfig | None
    eval_set: list[Problem]
    loop: StageLoop
    val: np.ndarray
    eval_windows: np.ndarray
    generation_batch: int
    """Most sequences one `generate` call makes: the plan counted their KV cache."""
    replay: Replay | None = None
    zero3_config: HfDeepSpeedConfig | None = None
    """Held for the run's life under ZeRO-3: transformers keeps only a weak reference to it."""
