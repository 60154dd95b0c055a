"""A broker of a test's own, on its own port and data, that the test may stop, start and resume.

The shared test broker (conftest.kafka_bootstrap) must never notice a test's outage.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Iterator

_BROKER = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "broker.sh"


def free_port_run(length: int = 2) -> int:
    """A port P with P + 1 .. P + length - 1 free too (broker.sh puts the KRaft controller on P + 1).

    Picked at run time, below the kernel's ephemeral range: a fixed port that something
    else holds fails the run, and a port from the ephemeral range can be taken by any
    client connection between the pick and the broker's start.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, max(20_001, low - length))
        try:
            for offset in range(length):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {length} consecutive free ports below {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_from_env(variable: str, length: int = 2) -> tuple[int, bool]:
    """The port ``variable`` names, or a free one of this run only (second item: True when picked)."""
    given = os.environ.get(variable)
    return (int(given), False) if given else (free_port_run(length), True)


def forget_broker_data(port: int) -> None:
    """Removes the data a broker of this run only left behind."""
    home = Path(os.environ.get("SPECWATCH_KAFKA_HOME") or Path.home() / ".cache" / "specwatch" / "kafka")
    shutil.rmtree(home / f"data-{port}", ignore_errors=True)
    (home / f"broker-{port}.lock").unlink(missing_ok=True)


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
