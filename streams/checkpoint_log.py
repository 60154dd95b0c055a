"""Stage-task checkpoints on a compacted topic (`CheckpointLog`): saved signed, loaded verified,
a refused one counted and the task rebuilt from its partition."""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Mapping

from specwatch.transport.kafka_io import acknowledged
from specwatch.transport.signing import Keyring

from .stage_tasks import (
    CheckpointError,
    Stage1Task,
    Stage2Task,
    checkpoint_entries,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
)

__all__ = ["CONVERT_PICKLED_ENV", "CheckpointLog", "convert_pickled_setting"]

logger = logging.getLogger(__name__)

CONVERT_PICKLED_ENV = "SPECWATCH_CONVERT_PICKLED_CHECKPOINTS"


class CheckpointLog:
    """Task checkpoints on a compacted topic, in the partition of the task's input partition.

    Signed with ``keyring`` when it holds a key; a checkpoint that is refused (forged, unsigned,
    undecodable...: `CheckpointError.reason`) is counted in ``refused`` by reason, logged once
    per task and reason, and the task rebuilds from its source topic. ``convert_pickled``: load
    a pickled checkpoint of an earlier version (default: only without a signing key).
    """

    def __init__(self, topic: str, writer: Any, reader: Any, keyring: Keyring | None = None,
                 convert_pickled: bool | None = None) -> None:
        self.topic = topic
        self._writer = writer
        self._reader = reader
        self._keyring = keyring if keyring is not None else Keyring.from_env()
        self._convert_pickled = not self._keyring.enabled if convert_pickled is None else convert_pickled
        self._sequence: dict[str, int] = {}
        self.refused: Counter = Counter()
        self._logged: set[tuple[str, str]] = set()

    async def load(self, name: str, partition: int) -> Stage1Task | Stage2Task | None:
        prefix = f"{name}#".encode()
        latest: dict[str, bytes] = {}
        begin = await self._reader.beginning_offset(self.topic, partition)
        end = (await self._reader.end_offsets(self.topic)).get(partition, begin)
        async for message in self._reader.iter_range(self.topic, partition, begin, end):
            if message.key and message.key.startswith(prefix) and message.value is not None:
                latest[message.key.decode()] = message.value
        found = read_checkpoint(name, latest.get)
        if found is None:
            return None
        sequence, data = found
        self._sequence[name] = sequence
        try:
            return decode_checkpoint(data, self._keyring, name, convert_pickled=self._convert_pickled)
        except CheckpointError as error:
            self.refused[error.reason] += 1
            if (name, error.reason) not in self._logged:
                self._logged.add((name, error.reason))
                logger.error("checkpoint %s refused (%s, %d so far): %s; the task rebuilds from its partition",
                             name, error.reason, self.refused[error.reason], error.detail)
            return None

    async def save(self, name: str, partition: int, task: Stage1Task | Stage2Task) -> int:
        """Write a checkpoint and wait until the broker has all of it; returns its size in bytes."""
        sequence = self._sequence.get(name, 0) + 1
        data = encode_checkpoint(task, self._keyring, name)
        sent = [await self._writer.send(self.topic, value, key=key.encode(), partition=partition)
                for key, value in checkpoint_entries(name, sequence, data)]
        await acknowledged(sent, "checkpoint chunks")
        self._sequence[name] = sequence
        return len(data)


def convert_pickled_setting(environ: Mapping[str, str] | None = None) -> bool | None:
    """``SPECWATCH_CONVERT_PICKLED_CHECKPOINTS``: 1 converts pickled checkpoints of earlier versions
    even with a signing key (the first start after an upgrade), 0 never; unset, the default."""
    value = (os.environ if environ is None else environ).get(CONVERT_PICKLED_ENV)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{CONVERT_PICKLED_ENV} must be 0 or 1, got {value!r}")
    return value == "1"
