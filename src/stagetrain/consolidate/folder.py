"""The consolidate stage: write model/<stage>/ and prove it holds the trained weights.

Everything is written into a temporary sibling folder; the folder is renamed
into place only after every written tensor was finite and the verification
passed. Otherwise nothing is left behind.

The weights stream from the checkpoint's files into the shards a chunk at a
time (`weights` says where each weight lies, `stored.Reader` reads only those
bytes, `writer` writes them), so the conversion holds one chunk, not the model.

Verification (`consolidate.verify`):
- `loss` (the default): the folder is reloaded with `from_pretrained` (which
  builds the model on the meta device and loads each weight once: the output
  dtype's bytes per parameter) and its validation loss must be finite and match
  the loss the training process logged for the same batch at the same step,
  within the tolerance stated below.
- `finite`: for models too big to load on the consolidating host. The shards
  are read back from disk a chunk at a time: each must parse as safetensors and
  hold exactly the model's weights, in the config's shapes and the output
  dtype, every value finite. Memory: one chunk.

Tolerances (relative): 1e-4 when the output dtype is the training precision
(the same weights, the same kernels); 2e-2 when it is not (bf16 output of an
fp32 run, or fp32 master weights of a bf16 run, evaluated in another precision).

A bf16 folder holds in fp32 what transformers keeps in fp32 whatever the dtype
(the model's `_keep_in_fp32_modules_strict`: DeepseekV3's routing bias and router
weights), as its own save_pretrained writes them: a routing bias trained in
steps of 0.001 would otherwise be rounded to bf16 before transformers upcasts it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import deepspeed
import numpy as np
import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.consolidate.manifest import MANIFEST, FiniteCheck, LossCheck, Manifest
from stagetrain.consolidate.stored import Reader, Region, Stored
from stagetrain.consolidate.weights import read_weights
from stagetrain.consolidate.writer import INDEX, SAFETENSORS_DTYPES, parse_size, write_shards
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.corpus.shards import sha256_file
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, atomic_write_text, read_json
from stagetrain.planning.plan import verifies_on_gpu
from stagetrain.tasks.problem import ANSWER_TOKEN, PROBLEM_TOKEN
from stagetrain.tasks.prompts import stop_ids
from stagetrain.training.engine import load_model_config
from stagetrain.training.evaluation import validation_loss
from stagetrain.training.summary import EvalBatch, StageSummary

log = logging.getLogger("stagetrain")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def tolerance(output: str, trained: str) -> float:
    """Relative tolerance of the reload check (see the module docstring)."""
    return 1e-4 if output == trained else 2e-2


def kept_in_fp32(names: Collection[str], patterns: Collection[str]) -> set[str]:
    """The `names` transformers keeps in fp32 in a 16-bit model: those that one of `patterns`
    (a model's `_keep_in_fp32_modules_strict`, '*' for any characters) matches anywhere, as
    transformers matches them when it loads."""
    if not patterns:
        return set()
    rule = re.compile("|".join(p.replace("*", ".*") for p in sorted(patterns)))
    return {name for name in names if rule.search(name)}


def output_dtypes(
    names: Collection[str], dtype: torch.dtype, keep: Collection[str]
) -> dict[str, torch.dtype]:
    """Each weight's dtype in the folder: `dtype`, but fp32 for what `keep` names under a 16-bit one."""
    kept = kept_in_fp32(names, keep) if dtype != torch.float32 else set()
    return {name: torch.float32 if name in kept else dtype for name in names}


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names that alias an earlier parameter (e.g. a tied lm_head.weight): not written, as transformers does."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def eval_loss(
    model: torch.nn.Module, batch: EvalBatch, dtype: str, device: torch.device | None = None
) -> float:
    """The training stage's validation loss on its recorded windows, recomputed with `model`."""
    shard = np.memmap(batch["shard"], dtype=dtype, mode="r")
    return validation_loss(model, shard, np.asarray(batch["windows"]), seq_len=batch["seq_len"],
                           micro_batch_size=batch["micro_batch_size"], device=device)  # fmt: skip


def consolidate(
    *,
    stage: str,
    summary_path: str,
    tokenizer_dir: str,
    model_config_path: str,
    meta_path: str,
    out: str,
    cfg: ConsolidateSettings,
    on_phase: Callable[[str], None] | None = None,
) -> Manifest:
    """Write the Hugging Face folder `out` for the stage's final checkpoint; return its manifest.

    `cfg` is the config's consolidate section. `on_phase`, if given, is called with "convert",
    "verify" and "describe" as each phase ends (benchmarks/consolidate_speed.py measures each
    phase's time, memory and reads through it). A write the filesystem refuses (a full disk) is
    one StageError naming the folder, and nothing is left."""
    summary: StageSummary = read_json(summary_path)
    meta: TokenizerMeta = read_json(meta_path)
    checkpoint = summary["checkpoint"]
    source = f"{checkpoint['folder']}/{checkpoint['tag']}"
    _check_reference(stage, summary)
    config = load_model_config(model_config_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    weights = read_weights(Path(checkpoint["folder"]), checkpoint["tag"], summary["layout"], shapes)
    names = sorted(set(shapes) - _tied_names(skeleton))
    _check_weights(names, shapes, weights, source)
    dtype = DTYPES[cfg.dtype]
    dtypes = output_dtypes(
        names, dtype, getattr(skeleton, "_keep_in_fp32_modules_strict", None) or ()
    )
    phase = on_phase or (lambda name: None)
    target = Path(out)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        start = time.perf_counter()
        _write(tmp, config, dtype, dtypes, tokenizer_dir, names, shapes, weights, cfg, source)
        log.info("wrote %d tensors from %s in %.1f s", len(names), source, time.perf_counter() - start)  # fmt: skip
        phase("convert")
        if cfg.verify == "loss":
            verification: LossCheck | FiniteCheck = _verify_loss(
                tmp, stage, summary, meta, cfg, dtype
            )
        else:
            verification = _verify_finite(tmp, stage, summary, names, shapes, dtypes)
        phase("verify")
        manifest = _describe(tmp, stage, summary, meta, cfg, verification)
        phase("describe")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno is not None:  # a full disk, a quota, read-only
            raise StageError(_write_failed(target, err)) from None
        raise
    return manifest


def _write_failed(target: Path, err: OSError) -> str:
    """The one line for a folder the filesystem would not take (ENOSPC and the like): the folder,
    the file and the system's reason; the temporary folder is already gone."""
    where = f" ({Path(err.filename).name})" if err.filename else ""
    return (
        f"{target}: could not write the consolidated folder{where}: {err.strerror or err}; "
        "nothing was written (free space there and rerun consolidate)"
    )


def _check_reference(stage: str, summary: StageSummary) -> None:
    """A run whose logged validation loss is not finite diverged: nothing to verify against."""
    reference = summary["final_eval_loss"]
    if not math.isfinite(reference):
        raise StageError(
            f"{stage}: the training logged a validation loss of {reference} at step {summary['final_step']}; "
            "a diverged run is not consolidated; nothing was written"
        )


def _check_weights(names: list[str], shapes: Mapping[str, tuple[int, ...]],
                   weights: Mapping[str, Stored], source: str) -> None:  # fmt: skip
    """Every weight the model config asks for is in the checkpoint, with as many elements."""
    missing = [n for n in names if n not in weights]
    if missing:
        raise StageError(f"{source}: no weights for {missing[0]} ({len(missing)} missing)")
    for name in names:
        if math.prod(weights[name].shape) != math.prod(shapes[name]):
            raise StageError(
                f"{source}: {name} has shape {weights[name].shape} in the checkpoint, "
                f"{shapes[name]} in the model config"
            )


def _write(tmp: Path, config: PretrainedConfig, dtype: torch.dtype, dtypes: Mapping[str, torch.dtype],
           tokenizer_dir: str, names: list[str], shapes: Mapping[str, tuple[int, ...]],
           weights: Mapping[str, Stored], cfg: ConsolidateSettings, source: str) -> None:  # fmt: skip
    config.dtype = dtype
    config.save_pretrained(tmp)
    stops = stop_ids(AutoTokenizer.from_pretrained(tokenizer_dir))  # where the sampler stops
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=stops, pad_token_id=config.pad_token_id
    ).save_pretrained(tmp)
    for path in sorted(Path(tokenizer_dir).iterdir()):
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, tmp / path.name)
    with Reader() as reader, _one_thread():

        def converted(name: str) -> Iterator[torch.Tensor]:
            for chunk in reader.chunks(weights[name]):
                # shards are written in data order: the first non-finite tensor is the one named
                if not finite_as(chunk, dtypes[name]):
                    raise StageError(
                        f"{source}: {name} holds non-finite values (NaN or inf) as {cfg.dtype}; "
                        "the checkpoint is damaged or training diverged; nothing was written"
                    )
                yield chunk.to(dtypes[name])

        write_shards(names, shapes, dtypes, converted, tmp, parse_size(cfg.max_shard_size))


def finite_as(chunk: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of `chunk` is finite once converted to `dtype`.

    Rounding is monotonic, so the chunk's extremes decide (an fp32 value beyond
    bf16's range becomes inf), and a NaN makes both extremes NaN. One aminmax
    pass costs about 1/25 of isfinite over the whole chunk.
    """
    if not chunk.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(chunk)).to(dtype)).all())


@contextmanager
def _one_thread() -> Iterator[None]:
    """Elementwise work on chunks of a few MiB is memory-bound: torch's threads only add their
    synchronisation (20-60x slower with two threads than one on a busy two-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def weights_sha256(shards: list[Path]) -> str:
    """One hash of the tensors themselves (sorted names, dtype, shape, bytes), whatever the sharding.

    The per-file hashes change with `consolidate.max_shard_size`; this one does
    not, so what starts from the folder (GRPO's checkpoint fingerprint) can tell
    the same weights in a new layout from new weights.
    """
    tensors = {}
    for path in shards:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        tensors.update({name: (path, 8 + size, info) for name, info in header.items()})
    digest = hashlib.sha256()
    for name in sorted(tensors):
        path, base, info = tensors[name]
        start, end = info["data_offsets"]
        digest.update(json.dumps([name, info["dtype"], info["shape"], end - start]).encode())
        with open(path, "rb") as handle:
            handle.seek(base + start)
            for left in range(end - start, 0, -(1 << 24)):
                digest.update(handle.read(min(left, 1 << 24)))
    return digest.hexdigest()


def _verify_loss(tmp: Path, stage: str, summary: StageSummary, meta: TokenizerMeta,
                 cfg: ConsolidateSettings, dtype: torch.dtype) -> LossCheck:  # fmt: skip
    """Reload the folder and reproduce the training's logged validation loss (module docstring),
    with the attention kernel the training ran: in bf16 the kernels round apart by more than
    the tolerance (sdpa against eager: 2.7e-4 relative on the default run)."""
    batch = summary["eval_batch"]
    logits = batch["micro_batch_size"] * batch["seq_len"] * meta["tokenizer_size"]
    need = sum(f.stat().st_size for f in tmp.glob("*.safetensors")) + logits * (dtype.itemsize + 8)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    # On the GPU where it fits, as the training computed its figure there: a 1B model's windows
    # took over 3.5 minutes on 16 CPU cores of the GPU check's machine, 22 s on its H200.
    device = torch.device("cuda" if verifies_on_gpu(need, free) else "cpu")
    log.info("%s: verifying on the %s (%.2f GiB for the model and one batch of logits)",
             stage, "GPU" if device.type == "cuda" else "CPU", need / 2**30)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        tmp, dtype=dtype, attn_implementation=summary["attention"]
    ).to(device)
    model.eval()
    loss = eval_loss(model, batch, meta["dtype"], device)
    del model
    reference = summary["final_eval_loss"]
    tol = tolerance(cfg.dtype, summary["layout"]["precision"])
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
    return {"method": "loss", "eval_loss": loss, "training_eval_loss": reference,
            "relative_tolerance": tol}  # fmt: skip


def _verify_finite(tmp: Path, stage: str, summary: StageSummary, names: list[str],
                   shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype]) -> FiniteCheck:  # fmt: skip
    """Read the shards back from disk, a chunk at a time: the model's weights, each finite."""
    files = sorted(set(read_json(tmp / INDEX)["weight_map"].values()))
    seen: dict[str, tuple[int, ...]] = {}
    with Reader() as reader, _one_thread():
        for filename in files:
            for name, stored in _shard_tensors(tmp / filename, stage, dtypes).items():
                seen[name] = stored.shape
                if not all(finite_as(chunk, stored.dtype) for chunk in reader.chunks(stored)):
                    raise StageError(f"{stage}: {name} reads back from {filename} with non-finite "
                                     "values; nothing was written")  # fmt: skip
    if seen != {name: tuple(shapes[name]) for name in names}:
        wrong = sorted(set(seen.items()) ^ {(n, tuple(shapes[n])) for n in names})[0][0]
        raise StageError(f"{stage}: the shards do not hold {wrong} as the model config shapes it; "
                         "nothing was written")  # fmt: skip
    log.info("verified: %d tensors read back from %d shards, all finite", len(seen), len(files))
    return {
        "method": "finite",
        "tensors": len(seen),
        "training_eval_loss": summary["final_eval_loss"],
    }


def _shard_tensors(path: Path, stage: str, dtypes: Mapping[str, torch.dtype]) -> dict[str, Stored]:
    """Where each tensor of a written shard lies, as safetensors itself parses the file (it refuses
    a header whose offsets do not fit the file), with the offsets from the header; each in the
    dtype it was meant to be written in (`dtypes`)."""
    try:
        with safe_open(path, framework="pt") as shard:
            names = list(shard.keys())
            found = {name: shard.get_slice(name).get_dtype() for name in names}
    except SafetensorError as err:
        raise StageError(f"{stage}: {path.name} does not read back as safetensors ({err}); "
                         "nothing was written") from None  # fmt: skip
    for name, kind in found.items():
        meant = dtypes.get(name)
        if meant is None or kind != SAFETENSORS_DTYPES[meant]:
            raise StageError(f"{stage}: {path.name} holds {name} as {kind}, not "
                             f"{SAFETENSORS_DTYPES[meant] if meant else 'a weight of the model'}; nothing was written")  # fmt: skip
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        entries = json.loads(handle.read(size))
    return {
        name: Stored(tuple(entries[name]["shape"]), (Region(path, 8 + size + entries[name]["data_offsets"][0],
                     dtypes[name], math.prod(entries[name]["shape"])),))
        for name in found
    }  # fmt: skip


def _describe(tmp: Path, stage: str, summary: StageSummary, meta: TokenizerMeta,
              cfg: ConsolidateSettings, verification: LossCheck | FiniteCheck) -> Manifest:  # fmt: skip
    """README.md (`folder_card`), then MANIFEST.json: what was consolidated, how it was verified,
    and every file's sha256, the card's too."""
    atomic_write_text(tmp / "README.md", folder_card(stage, summary, cfg, verification))
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    manifest: Manifest = {
        "stage": stage,
        "step": summary["final_step"],
        "tag": summary["checkpoint"]["tag"],
        "fingerprint": summary["fingerprint"],
        "layout": summary["layout"],
        "dtype": cfg.dtype,
        "tokenizer_size": meta["tokenizer_size"],
        "vocab_size": meta["model_vocab_size"],
        "verification": verification,
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
        "weights_sha256": weights_sha256([p for p in files if p.suffix == ".safetensors"]),
    }
    atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


def folder_card(stage: str, summary: StageSummary, cfg: ConsolidateSettings,
                verification: LossCheck | FiniteCheck) -> str:  # fmt: skip
    """The folder's own model card: what it holds, how it was checked, how to load and prompt it
    (the pipeline's markup; generate stops where its sampler does). `publish` puts the run's full
    card at the repo's root in place of the GRPO folder's."""
    checked = (
        f"its validation loss {verification['eval_loss']:.6f} reproduces the training's "
        f"{verification['training_eval_loss']:.6f}"
        if verification["method"] == "loss"
        else f"{verification['tensors']} tensors read back, all finite"
    )
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- stagetrain", "---", "",
        f"# stagetrain {stage} model", "",
        f"The {stage} stage's checkpoint `{summary['checkpoint']['tag']}` (step {summary['final_step']}) as a "
        f"Hugging Face folder in {cfg.dtype}; verified: {checked}. MANIFEST.json holds every file's sha256.", "",
        "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        "tokenizer = AutoTokenizer.from_pretrained(folder)", "model = AutoModelForCausalLM.from_pretrained(folder)",
        f'ids = tokenizer("{PROBLEM_TOKEN}12+34{ANSWER_TOKEN}", add_special_tokens=False, return_tensors="pt")',
        "out = model.generate(**ids, max_new_tokens=64, do_sample=False)  # stops at eos or a new problem",
        'print(tokenizer.decode(out[0, ids["input_ids"].shape[1]:]))', "```", "",
    ])  # fmt: skip
