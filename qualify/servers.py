"""The two paths qualification compares, when it starts them itself: vLLM OpenAI servers of one target,
standard and speculative, and the card the speculative one runs under (read from vLLM's own config)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from specwatch.schemas.contract import BundleCard

from .dataset import QualificationRequest
from .procedure import Endpoint

__all__ = ["ServerSettings", "bundle_card", "fitting_max_model_len", "rounded_max_model_len", "server_factory",
           "started"]

_LOG = logging.getLogger(__name__)
_MIN_MAX_MODEL_LEN = 512
_MAX_MODEL_LEN_STEP = 256


class ServerSettings:
    """How every server of one run starts: the target, dtypes, limits, and what the speculative path adds."""

    def __init__(self, model: str | Path, *, dtype: str = "float32", speculative_dtype: str | None = None,
                 speculative_env: Mapping[str, str] | None = None, max_model_len: int = 512,
                 max_num_seqs: int = 8, seed: int = 0) -> None:
        self.model = str(model)
        self.dtype = dtype
        self.speculative_dtype = speculative_dtype or dtype
        self.speculative_env = dict(speculative_env or {})
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed


def rounded_max_model_len(needed: int, ceiling: int | None = None) -> int:
    """``needed`` tokens rounded up to a multiple of 256, at least 512, at most ``ceiling`` (the
    model's own limit; a request beyond it is skipped at run time, not started for).

    >>> rounded_max_model_len(750), rounded_max_model_len(100), rounded_max_model_len(3000, ceiling=2048)
    (768, 512, 2048)
    """
    length = max(_MIN_MAX_MODEL_LEN, -(-needed // _MAX_MODEL_LEN_STEP) * _MAX_MODEL_LEN_STEP)
    return min(length, ceiling) if ceiling else length


def fitting_max_model_len(model: str | Path, requests: Sequence[QualificationRequest]) -> int:
    """The max-model-len that holds every request as written (prompt by the target's tokenizer, plus
    ``max_tokens``), rounded by `rounded_max_model_len` under the config's max_position_embeddings.
    Without a readable tokenizer: the least length (requests beyond it are then skipped when counted)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError) as error:
        _LOG.warning("no tokenizer for %s (%s): servers start at max_model_len %d", model, error, _MIN_MAX_MODEL_LEN)
        return _MIN_MAX_MODEL_LEN
    needed = 0
    for request in requests:
        if request.prompt is not None:
            text, special = request.prompt, True
        elif tokenizer.chat_template:
            text, special = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True,
                                                          tokenize=False), False
        else:
            continue
        prompt = len(tokenizer(text, add_special_tokens=special)["input_ids"])
        needed = max(needed, prompt + request.sampling.max_tokens)
    try:
        ceiling = json.loads((Path(model) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        ceiling = None
    return rounded_max_model_len(needed, ceiling if isinstance(ceiling, int) else None)


def bundle_card(settings: ServerSettings, speculative_config: dict) -> BundleCard:
    """The card of the speculative server, from the config vLLM builds for it (no model is loaded)."""
    from specwatch.collectors.vllm.bundle import describe_bundle
    from specwatch.engines.vllm.local_engine import configure_cpu_environment, quiet_vllm_logging

    quiet_vllm_logging()
    configure_cpu_environment()
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=settings.model, dtype=settings.speculative_dtype, enforce_eager=True,
                        seed=settings.seed, max_model_len=settings.max_model_len,
                        max_num_seqs=settings.max_num_seqs, speculative_config=speculative_config,
                        ).create_engine_config()
    return describe_bundle(config)


@contextlib.contextmanager
def started(settings: ServerSettings, speculative_config: dict | None) -> Iterator[Endpoint]:
    """One server of the run (standard decoding when ``speculative_config`` is None), stopped after."""
    from specwatch.engines.vllm.server import OpenAIServer

    speculative = speculative_config is not None
    with OpenAIServer(settings.model, speculative_config,
                      dtype=settings.speculative_dtype if speculative else settings.dtype,
                      per_request_metrics="detailed" if speculative else None,
                      env=settings.speculative_env if speculative else None,
                      max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
                      seed=settings.seed) as server:
        yield Endpoint(server.base_url, settings.model, settings.model, settings.max_model_len)


def server_factory(settings: ServerSettings):
    """The sweep's way to start the bundle's server at another configuration."""
    return lambda speculative_config: started(settings, speculative_config)
