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

    Stage 1 stamps each partials message (`stamp`, a header) with when its fetch was taken,
    when it was sent and, for each close among its slices, the watermark it moved to, when the
    telemetry message whose fold made that close was produced and when the close came; stage 2
    (`write`) takes the first close that passed the decided slice and adds when it read the
    message, its merge and decider seconds, and when the decisions were checkpointed (when
    they were decided, unless stage 2 checkpoints before publishing) and published. Workers append whole lines to one file (``O_APPEND``), so several may share it.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    @staticmethod
    def stamp(taken: float, closes: list[tuple[int, float, float]]) -> list[tuple[str, bytes]]:
        """The header for a partials message: ``closes`` are (watermark, produced, closed)."""
        return [(_TRACE_HEADER, json.dumps({"taken": taken, "sent": time.time(), "closes": closes}).encode())]

    @staticmethod
    def stamped(message: Any) -> dict | None:
        """The stamp stage 1 put on a partials message (None: it has none, e.g. a release)."""
        for name, value in getattr(message, "headers", None) or ():
            if name == _TRACE_HEADER:
                return json.loads(value)
        return None

    def write(self, outputs: list, stamp: dict | None, **times: float) -> None:
        """A line per decision of ``outputs`` (`SliceOutput`s), ``stamp`` from the message that finalized them.

        >>> import io, types
        >>> trace = DecisionTrace.__new__(DecisionTrace); trace._file = io.StringIO()
        >>> decision = types.SimpleNamespace(id="d-1", ts=8.0)
        >>> output = types.SimpleNamespace(slice_index=7, actions=[types.SimpleNamespace(decision=decision)])
        >>> trace.write([output], {"taken": 5.0, "sent": 6.0, "closes": [[6, 1.0, 5.1], [8, 2.0, 5.2]]}, published=7.0)
        >>> line = json.loads(trace._file.getvalue())
        >>> [line[k] for k in ("id", "telemetry_produced", "fetch_taken", "slice_closed", "partials_sent", "published")]
        ['d-1', 2.0, 5.0, 5.2, 6.0, 7.0]
        """
        for output in outputs:
            produced = closed = None
            if stamp is not None:
                passed = [close for close in stamp["closes"] if close[0] >= output.slice_index]
                _, produced, closed = (passed or stamp["closes"])[0]
            for action in output.actions:
                self._file.write(json.dumps({
                    "id": action.decision.id, "ts": action.decision.ts, "telemetry_produced": produced,
                    "fetch_taken": stamp and stamp["taken"], "slice_closed": closed,
                    "partials_sent": stamp and stamp["sent"], **times}) + "\n")

    def close(self) -> None:
        self._file.close()


def timestamp_seconds(timestamp: float) -> float:
    """A message's timestamp in seconds: Faust's messages give seconds, aiokafka's records milliseconds.

    >>> timestamp_seconds(1_700_000_000_500), timestamp_seconds(1_700_000_000.5)
    (1700000000.5, 1700000000.5)
    """
    return timestamp / 1000.0 if timestamp > 1e11 else float(timestamp)
