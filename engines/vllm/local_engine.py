"""A vLLM engine in this process on CPU, for tests and demos on the tiny models."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["configure_cpu_environment", "cpu_environment", "new_engine", "engine_args", "close_engine", "EngineRun",
           "quiet_vllm_logging", "run_to_completion", "spec_decode_counters"]

_LOG = logging.getLogger(__name__)

# Defaults only: a caller's explicit environment wins. vLLM reads its variables lazily and
# then caches them once an engine is up, so they must be in place before the first engine.
_CPU_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny models need a few MB
    # engine core and model runner in this process: Python sinks and flags reach them
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# vLLM logs to stdout by default, which must stay clean for --json output.
_QUIET_ENVIRONMENT = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                      "TQDM_DISABLE": "1"}
_DEFAULT_MAX_MODEL_LEN = 512
_DEFAULT_MAX_NUM_SEQS = 8


def quiet_vllm_logging() -> None:
    """Send vLLM's logs to stderr, errors only, before vLLM is first imported (defaults only)."""
    for name, value in _QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def cpu_environment(environ) -> dict[str, str]:
    """``environ`` with the CPU defaults an engine on local models needs where it sets none.

    >>> cpu_environment({"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"]
    '4'
    """
    return {**_CPU_ENVIRONMENT, **environ}


def configure_cpu_environment() -> None:
    """Set the environment an in-process CPU engine on local models needs (defaults only)."""
    for name, value in _CPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def new_engine(model: Path | str, speculative_config: dict | None, **options: Any) -> Any:
    """An `LLMEngine` on a local model, float32, eager, stat logging on (for vLLM's counters)."""
    configure_cpu_environment()
    _make_llvmlite_scan_safe()
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args(model, speculative_config, **options))


def engine_args(model: Path | str, speculative_config: dict | None, *, seed: int = 0,
                max_num_seqs: int = _DEFAULT_MAX_NUM_SEQS, max_model_len: int = _DEFAULT_MAX_MODEL_LEN,
                log_stats: bool = True) -> Any:
    """The `EngineArgs` new_engine starts from; ``create_engine_config()`` gives the config without a model."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="float32", enforce_eager=True, seed=seed,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      speculative_config=speculative_config, disable_log_stats=not log_stats)


def close_engine(engine: Any) -> None:
    """Stop an engine built by new_engine and release its memory before the next one."""
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del engine
    gc.collect()


@dataclass
class EngineRun:
    """Finished outputs by request id, and the wall time of every engine step."""

    outputs: dict[str, Any] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)


def run_to_completion(engine: Any, requests: Iterable[tuple[str, Any, Any]],
                      on_step: Callable[[int], None] | None = None) -> EngineRun:
    """Add ``(request_id, prompt, sampling_params)`` requests and step until all finish.

    ``on_step(i)`` runs after the i-th step (0-based), between engine steps: the place to
    flip flags or toggle a collector.
    """
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    run = EngineRun()
    step = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        run.step_seconds.append(time.perf_counter() - start)
        for output in outputs:
            if output.finished:
                run.outputs[output.request_id] = output
        if on_step is not None:
            on_step(step)
        step += 1
    return run


def spec_decode_counters(engine: Any) -> dict[str, Any]:
    """vLLM's own cumulative speculative-decoding counters (needs stat logging on)."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
    }
    counters: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                "accepted_per_pos": []}
    for metric in engine.get_metrics():
        key = names.get(metric.name)
        if key == "accepted_per_pos":
            counters[key] = [int(v) for v in metric.values]
        elif key is not None:
            counters[key] = int(metric.value)
    return counters


def _make_llvmlite_scan_safe() -> None:
    # vLLM 0.32's CPU platform, at every worker start, scans every attribute of every loaded
    # module with `hasattr(value, "__dict__")` and then `vars(value).get(...)`. llvmlite's
    # `ffi.lib` resolves *any* attribute lazily to a C function wrapper, "__dict__" included,
    # so `.get` fails with AttributeError. llvmlite is loaded with numba, which vLLM's ngram
    # drafter uses, so the second engine in a process (or the first, after any numba import)
    # cannot start. Giving the lazy table a real dict under "__dict__" makes the scan skip it.
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict) and "__dict__" not in table:
        table["__dict__"] = {}
        _LOG.debug("llvmlite function table made safe for vLLM's kernel-override scan")
