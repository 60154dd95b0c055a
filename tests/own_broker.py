"""A broker of a test's own, on its own port and data, that the test may stop, start and resume.

The shared test broker (conftest.kafka_bootstrap) must never notice a test's outage.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

_BROKER = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "broker.sh"


class OwnBroker:
    """``deploy/kafka/broker.sh`` on ``port``: `start` formats fresh storage, `resume` keeps it."""

    def __init__(self, port: int, partitions: int, extra: tuple[str, ...] = ()) -> None:
        self.port = port
        self.partitions = partitions
        self.extra = extra  # more options for start (e.g. a SASL listener)

    def __call__(self, command: str) -> str:
        options = list(self.extra) if command == "start" else []
        done = subprocess.run([str(_BROKER), command, "--port", str(self.port), "--partitions", str(self.partitions),
                               *options], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"broker.sh {command} failed:\n{done.stderr[-3000:]}"
        return done.stdout.strip()

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        """A fresh broker for the block; its bootstrap address; stopped after."""
        address = self("start")
        try:
            yield address
        finally:
            self("stop")
