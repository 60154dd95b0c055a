"""The two paths qualification compares, when it starts them itself: vLLM OpenAI servers of one target,
standard and speculative, and the card the speculative one runs under (read from vLLM's own config)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Mapping

from specwatch.schemas.contract import BundleCard

from .procedure import Endpoint

__all__ = ["ServerSettings", "bundle_card", "server_factory", "started"]


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
        yield Endpoint(server.base_url, settings.model, settings.model)


def server_factory(settings: ServerSettings):
    """The sweep's way to start the bundle's server at another configuration."""
    return lambda speculative_config: started(settings, speculative_config)
