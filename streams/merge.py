"""Stage 2: merges the partials of every source into the final slice once each source it waits for
has passed it (`Stage2`), and hands each final slice to the decider (`specwatch.actions.decider`)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

from specwatch.actions.decider import SliceDecider
from specwatch.actions.flags import FlagStore
from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas.outputs import SliceOutput
from specwatch.schemas.policy import Policy
from specwatch.schemas.scope import Scope as Key

from .slice_batch import SliceBatch

__all__ = ["Stage2"]


class Stage2:
    """Merges partials per slice once every source it waits for has passed it; its `decider`
    decides on each final slice, in slice order."""

    def __init__(self, policy: Policy, flags: FlagStore | None = None,
                 owns: Callable[[str], bool] | None = None, qualifications: dict | None = None) -> None:
        self.policy = policy
        self.decider = SliceDecider(policy, flags, owns, qualifications)
        self._slice_s = policy.windows.slice_seconds
        self._sources: dict[str, int] = {}
        self._released: set[str] = set()
        self._pending: dict[int, dict[str, list[SliceBatch]]] = defaultdict(dict)
        self.finalized = -1
        # CPU-clock seconds spent merging partials and deciding, for the decision trace (not state)
        self.merge_seconds = 0.0
        self.decide_seconds = 0.0

    def to_state(self) -> dict:
        """Sources and pending slices, then the decider's state, as plain data (the policy and
        ``owns`` are the owner's)."""
        return {"sources": self._sources, "released": sorted(self._released),
                "pending": [[index, [[source, [b.to_state() for b in batches]] for source, batches in by_source.items()]]
                            for index, by_source in self._pending.items()],
                "finalized": self.finalized, **self.decider.to_state()}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a stage made with the same policy)."""
        self._sources = {str(source): int(w) for source, w in state["sources"].items()}
        self._released = {str(source) for source in state["released"]}
        self._pending = defaultdict(dict, {int(index): {str(source): [SliceBatch.from_state(b) for b in batches]
                                                        for source, batches in by_source}
                                           for index, by_source in state["pending"]})
        self.finalized = int(state["finalized"])
        self.decider.load_state(state)

    def add(self, batch: SliceBatch) -> list[SliceOutput]:
        if batch.slice_index <= self.finalized and (batch.partials or batch.events):
            # a source so far behind that its slice was already decided: fold forward
            batch.slice_index = self.finalized + 1
        if batch.partials or batch.events or batch.late_records:
            self._pending[batch.slice_index].setdefault(batch.source, []).append(batch)
        self._sources[batch.source] = max(self._sources.get(batch.source, -1), batch.watermark)
        self._released.discard(batch.source)
        return self._finalize_ready()

    def release(self, source: str) -> list[SliceOutput]:
        """Stop waiting for ``source``, gone idle (`streams.sources.IdleRule`), until it sends again."""
        self._sources.setdefault(source, -1)
        self._released.add(source)
        return self._finalize_ready()

    def _finalize_ready(self, limit: int | None = None) -> list[SliceOutput]:
        if not self._sources:
            return []
        if limit is None:
            waited = [w for source, w in self._sources.items() if source not in self._released]
            limit = min(waited) if waited else max(self._sources.values())
        outputs = []
        for index in sorted(i for i in self._pending if i <= limit):
            outputs.append(self._finalize(index, self._pending.pop(index)))
        self.finalized = max(self.finalized, limit)
        return outputs

    def flush(self) -> list[SliceOutput]:
        """Decide every pending slice (end of input)."""
        if not self._pending:
            return []
        return self._finalize_ready(max(self._pending))

    def _finalize(self, index: int, by_source: dict[str, list[SliceBatch]]) -> SliceOutput:
        """Merge the batches of slice ``index``, sources in a fixed order, and decide on it."""
        started = time.perf_counter()
        merged: dict[Key, SliceStats] = {}
        copied: set[Key] = set()  # keys whose merged stats are this slice's own, not a batch's partial
        events: list[dict] = []
        late = 0
        seen_events = set()
        for source in sorted(by_source):  # fixed merge order: same sums however batches arrived
            for batch in by_source[source]:
                late += batch.late_records
                for key, stats in batch.partials.items():
                    mine = merged.get(key)
                    if mine is None:  # taken as it is; copied once a second partial comes
                        merged[key] = stats
                        continue
                    if key not in copied:
                        copied.add(key)
                        mine = merged[key] = mine.copy()
                    mine.merge(stats)
                for event in batch.events:
                    ident = (event["type"], event["ts"], event.get("worker"), event.get("id"), event.get("bundle_id"))
                    # a card re-sent, or an event read through two telemetry partitions: once
                    if ident not in seen_events:
                        seen_events.add(ident)
                        events.append(event)
        events.sort(key=lambda e: (e["ts"], e["type"], e.get("worker") or "", e.get("id") or ""))
        merged_at = time.perf_counter()
        self.merge_seconds += merged_at - started
        output = self.decider.decide(index, (index + 1) * self._slice_s, merged, events, late)
        self.decide_seconds += time.perf_counter() - merged_at
        return output
