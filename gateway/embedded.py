"""The gateway's records into an in-process pipeline (`streams.embedded`) on a thread of its own;
the pipeline's decisions land in its flag store, which the gateway routes by."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from specwatch.schemas import Decision
from specwatch.streams.embedded import EmbeddedPipeline

__all__ = ["EmbeddedFeed"]

logger = logging.getLogger(__name__)

_DEFAULT_QUEUE_SIZE = 65_536
# With no record for this long, the open slices are closed and decided: traffic that stops must
# not leave its last windows undecided.
_DEFAULT_IDLE_SECONDS = 2.0
_POLL_SECONDS = 0.2


class EmbeddedFeed:
    """A telemetry sink (``emit(record)``, never blocking) feeding one `EmbeddedPipeline` in order."""

    def __init__(self, pipeline: EmbeddedPipeline, *, idle_seconds: float = _DEFAULT_IDLE_SECONDS,
                 on_decision: Callable[[Decision], None] | None = None,
                 queue_size: int = _DEFAULT_QUEUE_SIZE) -> None:
        if not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be positive, got {idle_seconds}")
        self.pipeline = pipeline
        self.flags = pipeline.flags
        self.idle_seconds = idle_seconds
        self.on_decision = on_decision
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specwatch-gateway-pipeline", daemon=True)
        self._thread.start()

    def emit(self, record) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record emitted so far was fed; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def decide_open(self) -> list[Decision]:
        """Close and decide every open slice now (what going idle does)."""
        with self._lock:
            decided = self.pipeline.finish()
        self._announce(decided)
        return decided

    @property
    def decisions(self) -> list[Decision]:
        with self._lock:
            return list(self.pipeline.decisions)

    def shutdown(self) -> None:
        self.flush()
        self._stop.set()
        self._thread.join(5.0)
        self.decide_open()

    def _run(self) -> None:
        last = time.monotonic()
        pending = False  # records fed since the slices were last closed
        while not self._stop.is_set():
            try:
                record = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if pending and time.monotonic() - last >= self.idle_seconds:
                    pending = False
                    self.decide_open()
                continue
            try:
                with self._lock:
                    decided = self.pipeline.feed(record)
                self._announce(decided)
            except Exception:  # noqa: BLE001 - one bad record must not stop the feed
                logger.exception("the embedded pipeline failed on a %s record", getattr(record, "kind", "?"))
            finally:
                self._queue.task_done()
            last, pending = time.monotonic(), True

    def _announce(self, decided: list[Decision]) -> None:
        for decision in decided:
            logger.warning("decision %s: %s %s (bundle %s, bucket %s, cohort %s)", decision.id, decision.action,
                           decision.reason, decision.bundle_id, decision.bucket, decision.cohort)
            if self.on_decision is not None:
                self.on_decision(decision)
