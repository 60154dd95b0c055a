"""The real OpenTelemetry Collector (built by deploy/otelcol/build.sh), run by a test on free
ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from machine import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "deploy" / "otelcol"
_BUILD = CONFIGS / "build.sh"
_START_PATIENCE_S = 120.0  # liveness on a loaded machine, not a performance bound
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def collector_binary() -> str:
    """The cached Collector binary; built once per machine (minutes the first time)."""
    done = subprocess.run([str(_BUILD)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"deploy/otelcol/build.sh failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


class Collector:
    """One Collector process with ``config`` and ``env``; `metrics()` reads its own counters."""

    def __init__(self, config: Path, env: dict[str, str], log: Path) -> None:
        self.metrics_port = free_port()
        self.env = dict(os.environ, OTELCOL_METRICS_HOST="127.0.0.1", OTELCOL_METRICS_PORT=str(self.metrics_port),
                        **env)
        self.config = config
        self.log = log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Collector":
        with open(self.log, "w") as out:
            self.process = subprocess.Popen([collector_binary(), "--config", str(self.config)], env=self.env,
                                            stdout=out, stderr=subprocess.STDOUT)
        self.wait_for(lambda: "Everything is ready" in self.log.read_text(), "the start",
                      _START_PATIENCE_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def metrics(self) -> dict[str, float]:
        """The Collector's own metrics, summed over labels: name -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
        return out

    def wait_for(self, condition, what: str, patience_s: float = 300.0) -> None:
        deadline = time.monotonic() + patience_s
        while not condition():
            assert self.process.poll() is None, f"the Collector exited:\n{self.log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"{what} never happened:\n{self.log.read_text()[-4000:]}"
            time.sleep(0.2)
