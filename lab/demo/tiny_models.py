"""Tiny random-weight Llama models and a locally trained tokenizer for vLLM tests and demos.

No model hub: a BPE tokenizer trained on the standard library, a target, its copy, a random drafter.
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TINY_MODELS_VERSION", "TinyModels", "build_tiny_models", "default_cache_dir"]

_LOG = logging.getLogger(__name__)

# Bump when anything below changes what gets built: cached sets are keyed by it.
TINY_MODELS_VERSION = "v1"

_DEFAULT_VOCAB_SIZE = 2048
# Enough text for a stable 2k-token merge table while training in a few seconds.
_DEFAULT_CORPUS_BYTES = 4 << 20
_DEFAULT_TARGET_SEED = 1234
_DEFAULT_RANDOM_DRAFTER_SEED = 98765
# The usual initializer range: greedy decoding of such a small random network falls into
# loops within a few dozen tokens (about two thirds of its tokens are then predictable from
# an earlier 2-gram, so ngram speculation has something to draft), while the top-2 logit
# margins (1st percentile ~2e-3) stay far above float32 rounding differences between a
# one-token decode and a multi-token verification pass. Much larger ranges (0.1 and up)
# give loop-free text on which ngram drafts nothing.
_DEFAULT_INITIALIZER_RANGE = 0.02
_SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")


@dataclass(frozen=True)
class TinyModels:
    """Paths of one built set; every model directory also holds the tokenizer files."""

    root: Path
    target: Path
    copy_drafter: Path
    random_drafter: Path


def default_cache_dir() -> Path:
    """``$SPECWATCH_CACHE/tiny-models`` (default ``~/.cache/specwatch/tiny-models``)."""
    base = os.environ.get("SPECWATCH_CACHE") or os.path.join(Path.home(), ".cache", "specwatch")
    return Path(base) / "tiny-models"


def build_tiny_models(cache_dir: Path | None = None) -> TinyModels:
    """Build the tiny model set once (renamed into place, never half-written); return its paths."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = cache_dir / TINY_MODELS_VERSION
    if not (root / "complete").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODELS_VERSION}-", dir=cache_dir))
        try:
            staging.chmod(0o755)  # mkdtemp makes it private; the set is shared, read-only data
            _build(staging)
            (staging / "complete").write_text(TINY_MODELS_VERSION + "\n")
            try:
                os.rename(staging, root)
            except OSError:
                if not (root / "complete").exists():
                    # a stale, incomplete set from an interrupted build: replace it
                    shutil.rmtree(root, ignore_errors=True)
                    os.rename(staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return TinyModels(root=root, target=root / "target", copy_drafter=root / "copy-drafter",
                      random_drafter=root / "random-drafter")


def _build(root: Path) -> None:
    tokenizer = _train_tokenizer(_DEFAULT_VOCAB_SIZE)
    tokenizer.save_pretrained(root / "tokenizer")
    vocab_size = len(tokenizer)
    target = _random_llama(vocab_size, tokenizer, _DEFAULT_TARGET_SEED)
    for name, model in (("target", target), ("copy-drafter", target),
                        ("random-drafter", _random_llama(vocab_size, tokenizer, _DEFAULT_RANDOM_DRAFTER_SEED))):
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)
    (root / "vocab_size").write_text(f"{vocab_size}\n")
    _LOG.info("built tiny models in %s (vocab %d)", root, vocab_size)


def _corpus_files(limit_bytes: int) -> list[str]:
    """Python standard-library sources in a fixed order, up to ``limit_bytes`` in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if total + size > limit_bytes:
            continue
        chosen.append(str(path))
        total += size
    if not chosen:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return chosen


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train(_corpus_files(_DEFAULT_CORPUS_BYTES), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def _random_llama(vocab_size: int, tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
        max_position_embeddings=1024,
        initializer_range=_DEFAULT_INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
