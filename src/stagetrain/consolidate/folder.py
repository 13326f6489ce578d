"""The consolidate stage: write model/<stage>/ and prove it holds the trained weights.

Everything is written into a temporary sibling folder; the folder is renamed
into place only after every written tensor was finite and the reloaded model's
validation loss was finite and matched the loss the training process logged for
the same batch at the same step, within the tolerance stated below. Otherwise
nothing is left behind.

Tolerances (relative): 1e-4 when the output dtype is the training precision
(the same weights, the same kernels); 2e-2 when it is not (bf16 output of an
fp32 run, or fp32 master weights of a bf16 run, evaluated in another precision).
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from stagetrain.consolidate.weights import read_weights
from stagetrain.consolidate.writer import parse_size, write_shards
from stagetrain.corpus.shards import sha256_file
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json
from stagetrain.training.engine import load_model_config
from stagetrain.training.evaluation import validation_loss

log = logging.getLogger("stagetrain")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MANIFEST = "MANIFEST.json"


def tolerance(output: str, trained: str) -> float:
    """Relative tolerance of the reload check (see the module docstring)."""
    return 1e-4 if output == trained else 2e-2


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names that alias an earlier parameter (e.g. a tied lm_head.weight): not written, as transformers does."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def eval_loss(model: torch.nn.Module, batch: Mapping[str, Any], dtype: str) -> float:
    """The training stage's validation loss on its recorded windows, recomputed with `model`."""
    shard = np.memmap(batch["shard"], dtype=dtype, mode="r")
    return validation_loss(model, shard, np.asarray(batch["windows"]), seq_len=batch["seq_len"],
                           micro_batch_size=batch["micro_batch_size"])  # fmt: skip


def consolidate(
    *,
    stage: str,
    summary_path: str,
    tokenizer_dir: str,
    model_config_path: str,
    meta_path: str,
    out: str,
    cfg: Mapping[str, Any],
) -> dict[str, Any]:
    """Write the Hugging Face folder `out` for the stage's final checkpoint; return its manifest."""
    summary, meta = read_json(summary_path), read_json(meta_path)
    layout, checkpoint = summary["layout"], summary["checkpoint"]
    config = load_model_config(model_config_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    weights = read_weights(Path(checkpoint["folder"]), checkpoint["tag"], layout, shapes)
    names = sorted(set(shapes) - _tied_names(skeleton))
    missing = [n for n in names if n not in weights]
    if missing:
        raise StageError(
            f"{checkpoint['folder']}/{checkpoint['tag']}: no weights for {missing[0]} ({len(missing)} missing)"
        )
    dtype = DTYPES[cfg["dtype"]]
    target = Path(out)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, config, dtype, tokenizer_dir, names, shapes, weights, cfg,
               f"{checkpoint['folder']}/{checkpoint['tag']}")  # fmt: skip
        manifest = _verify_and_describe(tmp, stage, summary, meta, cfg, dtype)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write(tmp: Path, config: Any, dtype: torch.dtype, tokenizer_dir: str, names: list[str],
           shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, Any], cfg: Mapping[str, Any],
           source: str) -> None:  # fmt: skip
    config.dtype = dtype
    config.save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(tmp)
    for path in sorted(Path(tokenizer_dir).iterdir()):
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, tmp / path.name)
    sizes = {n: int(np.prod(shapes[n])) * dtype.itemsize for n in names}

    def materialise(name: str) -> torch.Tensor:
        value = weights[name]
        tensor = value if isinstance(value, torch.Tensor) else value.contiguous()
        tensor = tensor.to(dtype).contiguous().view(shapes[name])
        if not torch.isfinite(
            tensor
        ).all():  # shards are written in name order: the first one named
            raise StageError(
                f"{source}: {name} holds non-finite values (NaN or inf) as {cfg['dtype']}; "
                "the checkpoint is damaged or training diverged; nothing was written"
            )
        return tensor

    write_shards(names, sizes, materialise, tmp, parse_size(cfg["max_shard_size"]))


def _verify_and_describe(tmp: Path, stage: str, summary: Mapping[str, Any], meta: Mapping[str, Any],
                         cfg: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    model.eval()
    loss = eval_loss(model, summary["eval_batch"], meta["dtype"])
    del model
    reference = summary["final_eval_loss"]
    tol = tolerance(cfg["dtype"], summary["layout"]["precision"])
    if not math.isfinite(reference):
        raise StageError(
            f"{stage}: the training logged a validation loss of {reference} at step {summary['final_step']}; "
            "a diverged run is not consolidated; nothing was written"
        )
    if not math.isfinite(
        loss
    ):  # NaN compares false with everything: the tolerance test alone passes it
        raise StageError(
            f"{stage}: the consolidated model's validation loss is {loss} (the training logged "
            f"{reference:.6f} at step {summary['final_step']}); nothing was written"
        )
    if abs(loss - reference) > tol * abs(reference):
        raise StageError(
            f"{stage}: the consolidated model's validation loss {loss:.6f} differs from the {reference:.6f} "
            f"the training logged at step {summary['final_step']} by more than {tol:.0e} (relative); nothing was written"
        )
    log.info(
        "verified: validation loss %.6f, training logged %.6f (tolerance %.0e)",
        loss,
        reference,
        tol,
    )
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    manifest = {
        "stage": stage,
        "step": summary["final_step"],
        "tag": summary["checkpoint"]["tag"],
        "fingerprint": summary["fingerprint"],
        "layout": summary["layout"],
        "dtype": cfg["dtype"],
        "tokenizer_size": meta["tokenizer_size"],
        "vocab_size": meta["model_vocab_size"],
        "verification": {
            "eval_loss": loss,
            "training_eval_loss": reference,
            "relative_tolerance": tol,
        },
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
    }
    atomic_write_json(tmp / MANIFEST, manifest)
    return manifest
