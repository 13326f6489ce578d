"""The tokenizer: a byte-level BPE trained on the corpus, or a pretrained one, with our special tokens.

Trained tokenizers split digits one by one before BPE (so numbers are read
digit by digit, as arithmetic needs) and apply no normalisation, so decoding
gives back exactly the text that was encoded. Either way the result is saved in
the Hugging Face format and loads with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from stagetrain.config.settings import TokenizerSettings
from stagetrain.errors import StageError
from stagetrain.io import public_dir
from stagetrain.tasks.problem import CHAT_TEMPLATE, EOS_TOKEN, TASK_TOKENS

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": EOS_TOKEN, "pad_token": "<|pad|>"}


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (special tokens included) on `texts`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS.values(), *TASK_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        **SPECIAL_TOKENS,
        extra_special_tokens=list(TASK_TOKENS),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_pretrained(cfg: TokenizerSettings) -> PreTrainedTokenizerFast:
    """Load `tokenizer.path` and add (or check) the special tokens the pipeline needs."""
    if not cfg.path:
        raise StageError("tokenizer.path: required when tokenizer.source is 'pretrained'")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"tokenizer.path: cannot load {cfg.path!r}: {first}") from None
    if not tokenizer.is_fast:
        raise StageError(
            f"tokenizer.path: {cfg.path!r} has no fast (Rust) tokenizer; one is needed"
        )
    if cfg.pad_token is not None:
        if tokenizer.convert_tokens_to_ids(cfg.pad_token) in (None, tokenizer.unk_token_id):
            raise StageError(
                f"tokenizer.pad_token: {cfg.pad_token!r} is not a token of {cfg.path!r}"
            )
        tokenizer.pad_token = cfg.pad_token
    missing = {
        k: v
        for k, v in SPECIAL_TOKENS.items()
        if k != "bos_token" and getattr(tokenizer, k) is None
    }
    markers = [t for t in TASK_TOKENS if t not in tokenizer.get_vocab()]
    if (missing or markers) and not cfg.add_special_tokens:
        what = ", ".join([*(k.removesuffix("_token") for k in missing), *markers])
        raise StageError(
            f"tokenizer.add_special_tokens: false, but {cfg.path!r} lacks {what} "
            "(allow adding them, or set tokenizer.pad_token to an existing token)"
        )
    tokenizer.add_special_tokens(
        {**missing, "extra_special_tokens": markers} if markers else missing
    )
    return tokenizer


def save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> str:
    """Save into `folder` atomically (a sibling temp folder renamed); return the tokenizer's sha256."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tokenizer.save_pretrained(tmp)
        public_dir(tmp)
        digest = fingerprint(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digest


def fingerprint(folder: Path) -> str:
    """sha256 of the tokenizer's definition (tokenizer.json), which fixes every id."""
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
