"""The decision trace: where each decision's time went between the telemetry and the decisions
topic, as wall times stage 1 stamps on its partials messages and stage 2 writes out per decision."""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["DECISION_TRACE_ENV", "DecisionTrace", "timestamp_seconds"]

DECISION_TRACE_ENV = "SPECWATCH_DECISION_TRACE"
# Stage 1's wall times for the slices a partials message carries, read back by stage 2.
_TRACE_HEADER = "specwatch-trace"


class DecisionTrace:
    """One JSON line per decision in a file: the wall times of its path through both stages.

    Stage 1 stamps each partials message (`stamp`, a header) with when the telemetry message
    whose fold first closed one of its slices was produced, when its fetch was taken, when
    that close came and when the message was sent; stage 2 adds when it read the message,
    its merge and decider seconds, and when the decisions were checkpointed and published.
    Workers append whole lines to one file (``O_APPEND``), so several may share it.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    @staticmethod
    def stamp(produced: float, taken: float, closed: float) -> list[tuple[str, bytes]]:
        return [(_TRACE_HEADER, json.dumps([produced, taken, closed, time.time()]).encode())]

    @staticmethod
    def stamped(message: Any) -> list[float] | None:
        """The stamp stage 1 put on a partials message (None: it has none)."""
        for name, value in getattr(message, "headers", None) or ():
            if name == _TRACE_HEADER:
                return json.loads(value)
        return None

    def write(self, decisions: list, stamp: list[float] | None, **times: float) -> None:
        produced, taken, closed, sent = stamp if stamp is not None else (None,) * 4
        for decision in decisions:
            self._file.write(json.dumps({
                "id": decision.id, "ts": decision.ts, "telemetry_produced": produced, "fetch_taken": taken,
                "slice_closed": closed, "partials_sent": sent, **times}) + "\n")

    def close(self) -> None:
        self._file.close()


def timestamp_seconds(timestamp: float) -> float:
    """A message's timestamp in seconds: Faust's messages give seconds, aiokafka's records milliseconds.

    >>> timestamp_seconds(1_700_000_000_500), timestamp_seconds(1_700_000_000.5)
    (1700000000.5, 1700000000.5)
    """
    return timestamp / 1000.0 if timestamp > 1e11 else float(timestamp)
