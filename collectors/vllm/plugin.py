"""vLLM general plugin (entry point ``specwatch``): installs specwatch's hooks in each vLLM process.

Binds engines to a collector given in Python (``VllmCollector.watching()``) or by the environment.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import threading
from typing import Any

__all__ = ["register", "watching", "collector_for", "ENV_SINK", "ENV_FLAGS", "ENV_WORKER",
           "ENV_LABELER", "ENV_POLICY"]

_LOG = logging.getLogger(__name__)

# Zero-argument factories as "package.module:callable" (docs/DEPLOY.md, "Inside the collector").
ENV_SINK = "SPECWATCH_VLLM_SINK"
ENV_FLAGS = "SPECWATCH_VLLM_FLAGS"
ENV_LABELER = "SPECWATCH_VLLM_LABELER"  # names the labeler itself, not a factory
ENV_WORKER = "SPECWATCH_VLLM_WORKER"
# A policy file whose [capture] section turns sealed sample capture on (key: SPECWATCH_SAMPLE_KEY_FILE).
ENV_POLICY = "SPECWATCH_VLLM_POLICY"

# Per process: hooks installed once, the collectors of open `watching()` blocks (innermost
# last: engines built now bind to it), and the collector built from the environment.
_lock = threading.Lock()
_installed = False
_watching: list[Any] = []
_from_env: Any = None
_env_checked = False


def register() -> None:
    """Entry point vLLM calls in each of its processes; cheap and idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        from . import hooks

        hooks.install(collector_for)
        _installed = True
    _LOG.debug("specwatch vLLM hooks installed in process %d", os.getpid())


@contextlib.contextmanager
def watching(collector: Any) -> Any:
    """Bind the engines built in this process to ``collector`` while the block runs."""
    register()
    with _lock:
        _watching.append(collector)
    try:
        yield collector
    finally:
        with _lock:
            del _watching[max(i for i, c in enumerate(_watching) if c is collector)]


def collector_for(role: str) -> Any:
    """The collector a runner or scheduler built now binds to: watching() first, then env."""
    with _lock:
        if _watching:
            return _watching[-1]
    return _env_collector()


def _env_collector() -> Any:
    global _from_env, _env_checked
    with _lock:
        if _env_checked:
            return _from_env
        _env_checked = True
        sink_name = os.environ.get(ENV_SINK, "").strip()
        flags_name = os.environ.get(ENV_FLAGS, "").strip()
        if not sink_name and not flags_name:
            return None
        from .collector import VllmCollector

        from specwatch.collectors.otlp_export import service_instance_id

        labeler_name = os.environ.get(ENV_LABELER, "").strip()
        policy_path = os.environ.get(ENV_POLICY, "").strip()
        capture = None
        if policy_path and sink_name:
            from specwatch.collectors.capture import SampleCapture
            from specwatch.schemas import load_policy

            capture = SampleCapture.from_policy(load_policy(policy_path).capture)
        _from_env = VllmCollector(
            _LazySink(_resolve(ENV_SINK, sink_name)) if sink_name else None,
            flags=_resolve(ENV_FLAGS, flags_name)() if flags_name else None,
            # the contract's worker is the OTel resource's service.instance.id when not named here
            worker=os.environ.get(ENV_WORKER, "").strip() or service_instance_id(),
            labeler=_resolve(ENV_LABELER, labeler_name) if labeler_name else None,
            capture=capture,
        )
        # the emitter is a daemon thread: hand queued records to the sink before the process ends
        atexit.register(_from_env.close)
        _LOG.info("specwatch collector configured from the environment in process %d "
                  "(sink: %s, flags: %s)", os.getpid(), sink_name or "none", flags_name or "none")
        return _from_env


def _resolve(variable: str, name: str) -> Any:
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{variable}={name!r}: expected 'package.module:callable'")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{variable}={name!r} cannot be loaded: {error}") from error
    if not callable(target):
        raise ValueError(f"{variable}={name!r} is not callable")
    return target


class _LazySink:
    """Builds the configured sink on the first record, in the collector's emitter thread."""

    def __init__(self, factory: Any) -> None:
        self._factory = factory
        self._sink: Any = None

    def emit(self, record: Any) -> None:
        if self._sink is None:
            self._sink = self._factory()
        self._sink.emit(record)

    def _close_owned(self) -> None:
        # a sink built from the environment is owned by the collector, so it is closed here
        for name in ("shutdown", "close"):
            close = getattr(self._sink, name, None)
            if callable(close):
                close()
                return
