"""An unmodified vLLM OpenAI-compatible server as a child process, on a free loopback port.

What qualification and the gateway talk to: the server a platform team runs, started here on
local models (the tiny ones in tests and demos) with the CPU environment, and stopped cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .local_engine import cpu_environment

__all__ = ["OpenAIServer", "ServerStartError", "free_loopback_port"]

_DEFAULT_STARTUP_TIMEOUT_S = 300.0
_DEFAULT_STOP_TIMEOUT_S = 30.0
_DEFAULT_MAX_MODEL_LEN = 512
_DEFAULT_MAX_NUM_SEQS = 8
_HEALTH_POLL_S = 0.5
_LOG_TAIL_BYTES = 4000
# The server's engine core is its own process: unlike an in-process engine, it may (and on
# 2 cores should) keep vLLM's default multiprocessing, so the API loop stays responsive.
_SERVER_ENVIRONMENT_DROP = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model``, as a context manager.

    Parameters
    ----------
    model
        Local model directory (it holds the tokenizer too).
    speculative_config
        vLLM's ``--speculative-config`` as a dict; ``None`` serves standard decoding.
    dtype
        The target's dtype; another dtype than the standard path's is a lossy variant.
    per_request_metrics
        ``summary`` or ``detailed`` (``--per-request-spec-decode-metrics``), ``None`` to leave off.
    extra_args
        More server arguments, appended as given.
    env
        Variables added to the server's environment (e.g. a ``PYTHONPATH`` holding a plugin).

    The port is chosen when the server starts (``free_loopback_port``); the log goes to a file
    (``log_path``) whose tail is quoted when the server fails to start.
    """

    def __init__(self, model: Path | str, speculative_config: Mapping[str, Any] | None = None, *,
                 dtype: str = "float32", per_request_metrics: str | None = "summary",
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 max_model_len: int = _DEFAULT_MAX_MODEL_LEN, max_num_seqs: int = _DEFAULT_MAX_NUM_SEQS,
                 seed: int = 0, startup_timeout: float = _DEFAULT_STARTUP_TIMEOUT_S,
                 served_model_name: str | None = None) -> None:
        if per_request_metrics not in (None, "summary", "detailed"):
            raise ValueError(f"per_request_metrics must be summary, detailed or None, got {per_request_metrics!r}")
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be positive, got {startup_timeout}")
        self.model = Path(model)
        self.speculative_config = dict(speculative_config) if speculative_config else None
        self.dtype = dtype
        self.per_request_metrics = per_request_metrics
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.startup_timeout = startup_timeout
        self.served_model_name = served_model_name
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not started")
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        """The server's command line on ``port``."""
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype, "--enforce-eager",
                   "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                   "--seed", str(self.seed)]
        if self.served_model_name:
            command += ["--served-model-name", self.served_model_name]
        if self.speculative_config is not None:
            command += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.per_request_metrics is not None:
            command += ["--per-request-spec-decode-metrics", self.per_request_metrics]
        return command + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        # the child's environment only: the caller's own stays as it is
        env = {name: value for name, value in cpu_environment(os.environ).items()
               if name not in _SERVER_ENVIRONMENT_DROP}
        for name, value in self.env.items():
            if name == "PYTHONPATH" and env.get("PYTHONPATH"):
                value = os.pathsep.join((value, env["PYTHONPATH"]))
            env[name] = value
        return env

    def start(self) -> OpenAIServer:
        if self.process is not None:
            raise RuntimeError("the server is already started")
        self.port = free_loopback_port()
        handle, name = tempfile.mkstemp(prefix=f"vllm-server-{self.port}-", suffix=".log")
        self.log_path = Path(name)
        with open(handle, "wb") as log:
            # its own process group: stop() ends the engine core it spawns as well
            self.process = subprocess.Popen(self.command(self.port), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"vLLM server exited with code {code} before it was healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(_HEALTH_POLL_S)
        raise ServerStartError(f"vLLM server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            return log.read().decode("utf-8", "replace")

    def kill(self) -> None:
        """End the server at once (SIGKILL to its process group), as a crash would."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def stop(self, timeout: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._signal(signal.SIGKILL)  # whatever of its group outlived it

    def _signal(self, number: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, number)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
