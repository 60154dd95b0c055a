"""Action handlers: what happens to each final slice's decisions beyond the flag store.

The archive handler writes decisions with their audit evidence and samples, window
statistics for timelines, and every bundle card seen; writes are batched.
"""

from __future__ import annotations

import logging

from specwatch.streams.topology import SliceOutput

__all__ = ["ArchiveSink"]

_LOG = logging.getLogger(__name__)
# Window rows arrive one per key per slice; inserting them in large batches is what
# makes the archive keep up (ClickHouse prefers few big inserts).
_DEFAULT_WINDOW_BATCH = 5000


class ArchiveSink:
    """Writes stage-2 output to an `Archive`; decisions at once, window rows in batches."""

    def __init__(self, archive, window_batch: int = _DEFAULT_WINDOW_BATCH) -> None:
        self.archive = archive
        self.window_batch = window_batch
        self._rows: list[dict] = []
        self.decisions_written = 0

    def __call__(self, output: SliceOutput) -> None:
        for bundle in output.bundles:
            self.archive.write_bundle(bundle["bundle_id"], bundle["card"], bundle["ts"], bundle["worker"])
        for action in output.actions:
            self.archive.write_decision(action.decision, action.audit, action.samples)
            self.decisions_written += 1
        self._rows.extend(output.window_rows)
        if len(self._rows) >= self.window_batch:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            self.archive.write_window_stats(self._rows)
            self._rows = []

    def close(self) -> None:
        self.flush()
