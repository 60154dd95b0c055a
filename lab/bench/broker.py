"""A Kafka broker of one run's own: ``deploy/kafka/broker.sh`` on a port picked at run time, for the
bench and for tests whose broker outage the shared test broker must never notice."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BROKER_SCRIPT", "OwnBroker", "broker_data_dir", "forget_broker_data", "free_port_run", "port_from_env"]

BROKER_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "broker.sh"
# A first start resolves the broker's jars from Maven Central; later ones take 10-30 s.
_DEFAULT_TIMEOUT_S = 600
_FIRST_PORT = 20_000
_EPHEMERAL_DEFAULT = (32768, 60999)


def free_port_run(length: int = 2) -> int:
    """A port P with P + 1 .. P + length - 1 free too (broker.sh puts the KRaft controller on
    P + 1), below the ephemeral range, where a client connection could take it before the start."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_FIRST_PORT, max(_FIRST_PORT + 1, low - length))
        try:
            for offset in range(length):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {length} consecutive free ports between {_FIRST_PORT} and {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def port_from_env(variable: str, length: int = 2) -> tuple[int, bool]:
    """The port ``variable`` names, or a free one of this run only (second item: True when picked)."""
    given = os.environ.get(variable)
    return (int(given), False) if given else (free_port_run(length), True)


def broker_data_dir(port: int) -> Path:
    """Where broker.sh keeps the data (and log) of the broker on ``port``."""
    return _kafka_home() / f"data-{port}"


def forget_broker_data(port: int) -> None:
    """Removes the data a broker of this run only left behind."""
    shutil.rmtree(broker_data_dir(port), ignore_errors=True)
    (_kafka_home() / f"broker-{port}.lock").unlink(missing_ok=True)


def _kafka_home() -> Path:
    return Path(os.environ.get("SPECWATCH_KAFKA_HOME") or Path.home() / ".cache" / "specwatch" / "kafka")


class OwnBroker:
    """``deploy/kafka/broker.sh`` on ``port`` (its KRaft controller on the next): `start` formats
    fresh storage, `resume` keeps it; ``extra`` options go to ``start`` (a SASL listener)."""

    def __init__(self, port: int, partitions: int, extra: tuple[str, ...] = ()) -> None:
        self.port = port
        self.partitions = partitions
        self.extra = extra

    def __call__(self, command: str) -> str:
        """Run ``broker.sh COMMAND`` for this port; its stdout (the address, for start)."""
        if not BROKER_SCRIPT.is_file():
            raise RuntimeError(f"{BROKER_SCRIPT} is missing: run from a specwatch checkout, or pass --bootstrap")
        options = list(self.extra) if command == "start" else []
        done = subprocess.run([str(BROKER_SCRIPT), command, "--port", str(self.port), "--partitions",
                               str(self.partitions), *options], capture_output=True, text=True,
                              timeout=_DEFAULT_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"broker.sh {command} --port {self.port} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
        return done.stdout.strip()

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        """A fresh broker for the block; its bootstrap address; stopped after."""
        address = self("start")
        try:
            yield address
        finally:
            self("stop")

    @classmethod
    @contextlib.contextmanager
    def of_this_run(cls, partitions: int = 4) -> Iterator[str]:
        """A fresh broker on a free port for the block; its address; stopped and its data removed after."""
        broker = cls(free_port_run(), partitions)
        try:
            with broker.running() as address:
                yield address
        finally:
            forget_broker_data(broker.port)
