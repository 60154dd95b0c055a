"""The fingerprint card of a running vLLM engine, read from its real configuration.

Revisions of local checkpoints and the tokenizer digest hash the files the engine loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from specwatch.schemas import BundleCard, DrafterCard, PolicyCard, RuntimeCard, TargetCard

__all__ = ["describe_bundle", "drafter_mechanism", "drafter_revision", "checkpoint_revision", "tokenizer_digest"]

_LOG = logging.getLogger(__name__)

# Files that decide how text becomes token ids: a change in any of them voids the drafter's
# evidence even when the weights are the same.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "chat_template.jinja", "chat_template.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Up to this many bytes of weights are hashed in full. Beyond it (real checkpoints are tens of
# GB), each weight file contributes its size and its first and last _DEFAULT_SAMPLE_BYTES: a
# fine-tune or re-quantization rewrites every tensor, so it changes those bytes too, while
# engine start-up does not wait for a full read.
_DEFAULT_FULL_HASH_BYTES = 512 << 20
_DEFAULT_SAMPLE_BYTES = 4 << 20
_MAX_NAME_CHARS = 256


def describe_bundle(vllm_config: Any) -> BundleCard:
    """Fingerprint card of a speculative vLLM engine; raises ValueError without speculation."""
    import vllm

    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        raise ValueError("the engine has no speculative_config: there is no speculative bundle "
                         "to describe (pass speculative_config to LLM/EngineArgs)")
    target = TargetCard(
        model_id=_name(str(model_config.model)),
        revision=model_config.revision or checkpoint_revision(model_config.model),
        tokenizer_digest=tokenizer_digest(model_config.tokenizer,
                                          getattr(model_config, "tokenizer_revision", None)),
        quantization=f"{model_config.quantization or 'none'}/"
                     f"{str(model_config.dtype).removeprefix('torch.')}",
    )
    drafter = DrafterCard(
        mechanism=drafter_mechanism(spec.method),
        revision=drafter_revision(spec),
        draft_length=int(spec.num_speculative_tokens),
    )
    parallel = vllm_config.parallel_config
    parallelism = (f"tp{parallel.tensor_parallel_size}-pp{parallel.pipeline_parallel_size}"
                   f"-dp{parallel.data_parallel_size}")
    if getattr(parallel, "enable_expert_parallel", False):
        parallelism += "-ep"
    runtime = RuntimeCard(engine=f"vllm-{vllm.__version__}", gpu=_device_name(vllm_config),
                          parallelism=parallelism)
    rule = getattr(spec, "rejection_sample_method", "standard")
    # vLLM's "standard" rejection sampling is the lossless acceptance rule; "synthetic" and
    # "block" are not, and the card must say so.
    policy = PolicyCard(acceptance_rule="strict" if rule == "standard" else str(rule),
                        fallback="standard")
    return BundleCard(target=target, drafter=drafter, runtime=runtime, policy=policy)


def drafter_mechanism(method: str | None) -> str:
    """The contract's drafter mechanism for a vLLM speculative method.

    >>> [drafter_mechanism(m) for m in ("ngram", "ngram_gpu", "eagle3", "deepseek_mtp", "draft_model")]
    ['ngram', 'ngram', 'eagle3', 'mtp', 'external']
    """
    method = method or ""
    if method in ("ngram", "ngram_gpu"):
        return "ngram"
    if method in ("eagle3", "dflash", "dspark"):
        return method
    if method == "mtp" or method.endswith("_mtp"):
        return "mtp"
    # EAGLE-1, Medusa, MLP speculators, suffix decoding, separate draft models: the exact
    # vLLM method name is kept in the drafter revision.
    return "external"


def drafter_revision(spec: Any) -> str:
    """The drafter's revision on the card, from a speculative config's attributes (vLLM's, or a
    namespace over the JSON a server was started with)."""
    method = spec.method or ""
    if method in ("ngram", "ngram_gpu"):
        return f"{method}:lookup={spec.prompt_lookup_min}-{spec.prompt_lookup_max}"
    if method == "suffix":
        return f"suffix:depth={spec.suffix_decoding_max_tree_depth}"
    model = spec.model or ""
    revision = spec.revision or (checkpoint_revision(model) if model else "")
    return _name(f"{method}:{model}@{revision}" if model else method)


def checkpoint_revision(model: str | os.PathLike) -> str:
    """``sha256:<16 hex>`` of a local checkpoint's config and weights; "" for hub ids."""
    root = Path(model)
    if not root.is_dir():
        return ""
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and (p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES)))
    if not files:
        return ""
    total = sum(p.stat().st_size for p in files)
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if total <= _DEFAULT_FULL_HASH_BYTES or size <= 2 * _DEFAULT_SAMPLE_BYTES:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            else:
                digest.update(f.read(_DEFAULT_SAMPLE_BYTES))
                f.seek(size - _DEFAULT_SAMPLE_BYTES)
                digest.update(f.read(_DEFAULT_SAMPLE_BYTES))
    return "sha256:" + digest.hexdigest()[:16]


def tokenizer_digest(tokenizer: str | os.PathLike, revision: str | None = None) -> str:
    """``sha256:<16 hex>`` over the tokenizer files the engine loads (hub ids: the local cache).

    Without files it hashes the id and revision, so a change of either still changes the card.
    """
    root = Path(tokenizer)
    found: list[tuple[str, Path]] = []
    if root.is_dir():
        found = [(name, root / name) for name in _TOKENIZER_FILES if (root / name).is_file()]
    else:
        found = _cached_hub_files(str(tokenizer), revision)
    digest = hashlib.sha256()
    if not found:
        digest.update(f"id:{tokenizer}@{revision or ''}".encode())
    for name, path in found:
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes())
    return "sha256:" + digest.hexdigest()[:16]


def _cached_hub_files(repo_id: str, revision: str | None) -> list[tuple[str, Path]]:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - vLLM depends on huggingface_hub
        return []
    found = []
    for name in _TOKENIZER_FILES:
        try:
            cached = try_to_load_from_cache(repo_id, name, revision=revision)
        except Exception:  # malformed ids are the caller's problem, not a reason to fail
            return []
        if isinstance(cached, str):
            found.append((name, Path(cached)))
    return found


def _device_name(vllm_config: Any) -> str:
    from vllm.platforms import current_platform

    device_type = str(getattr(vllm_config.device_config, "device_type", "") or current_platform.device_type)
    if device_type == "cpu":
        return f"cpu:{_cpu_model()}" if _cpu_model() else "cpu"
    try:
        return _name(f"{device_type}:{current_platform.get_device_name(0)}")
    except Exception:  # some platforms cannot name a device before it is initialised
        return device_type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _name(value: str) -> str:
    # Card fields are bounded names; a long local path keeps its most specific end.
    return value if len(value) <= _MAX_NAME_CHARS else value[-_MAX_NAME_CHARS:]
