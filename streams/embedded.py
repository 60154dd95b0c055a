"""The topology in one process, no broker: the ingest step, stage 1, stage 2, action handlers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from specwatch.actions.flags import FlagStore
from specwatch.schemas import Decision, Policy, RejectionCounter
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.outputs import SliceOutput
from specwatch.schemas.step_block import StepBlock

from .combine import Stage1
from .merge import Stage2
from .sources import Ingest, Ingested

__all__ = ["EmbeddedPipeline", "PipelineCounters"]

# Rejected and late records listed by line; the counts go on past this.
_MAX_FLAGGED_LINES = 100


@dataclass
class PipelineCounters:
    """What went in and what came out; ``flagged`` names the first rejected or late records by line."""

    lines: int = 0
    records: int = 0
    rejected: RejectionCounter = field(default_factory=RejectionCounter)
    late_records: int = 0
    decisions: int = 0
    slices: int = 0
    flagged: list[dict] = field(default_factory=list)

    def flag(self, reason: str, detail: str, line: int | None = None) -> None:
        """Note ``line`` (by default the current line, 0 when records come without lines) as rejected or late."""
        if len(self.flagged) < _MAX_FLAGGED_LINES:
            self.flagged.append({"line": self.lines if line is None else line, "reason": reason, "detail": detail})

    def as_dict(self) -> dict:
        return {
            "lines": self.lines,
            "records": self.records,
            "rejected": self.rejected.total,
            "rejected_by_reason": self.rejected.as_dict(),
            "late_records": self.late_records,
            "decisions": self.decisions,
            "slices": self.slices,
            "flagged": list(self.flagged),
        }


class EmbeddedPipeline:
    """Feeds records through both stages in-process and hands each final slice to ``sinks``."""

    def __init__(self, policy: Policy | None = None, flags: FlagStore | None = None,
                 sinks: Iterable[Callable[[SliceOutput], None]] = (),
                 clock: Callable[[], float] | None = None, qualifications: dict | None = None) -> None:
        self.policy = policy or Policy()
        self._clock = clock
        self.flags = flags if flags is not None else FlagStore()
        self.stage1 = Stage1(self.policy, source="embedded")
        self.stage2 = Stage2(self.policy, self.flags, qualifications=qualifications)
        self.ingest = Ingest(self.stage1)
        self.sinks = list(sinks)
        self.counters = PipelineCounters(rejected=self.ingest.rejected)
        self.decisions: list[Decision] = []

    def feed_line(self, line: str | bytes) -> list[Decision]:
        """One JSON line; rejected and late records are flagged by its number."""
        self.counters.lines += 1
        return self._take(self.ingest(line, self._now()))

    def feed(self, record) -> list[Decision]:
        return self.feed_many((record,))

    def feed_many(self, records: Iterable) -> list[Decision]:
        """Decoded records in order, e.g. an OTLP request decoded (its rejections are counted)."""
        decided: list[Decision] = []
        ingested = self.ingest.records(records, self._now(), on_closed=lambda ready: decided.extend(self._drain(ready)))
        return decided + self._take(ingested)

    def feed_lines(self, lines: Sequence[bytes | str], native: bool = True) -> list[Decision]:
        """A block of JSON lines at once (the batch mode of `feed_line`); ``native=False``: without
        the compiled step walk even where it is loaded."""
        first_line = self.counters.lines
        self.counters.lines += len(lines)
        return self._take(self.ingest.block(decode_lines_block(lines, native), self._now()), first_line)

    def feed_block(self, block: StepBlock) -> list[Decision]:
        """Decoded records in the batch mode, e.g. ``request_block(request)``:
        what `feed_many` makes of the same records, the slices they close decided at the end."""
        return self._take(self.ingest.block(block, self._now()))

    def _now(self) -> float | None:
        return None if self._clock is None else self._clock()

    def _take(self, ingested: Ingested, first_line: int | None = None) -> list[Decision]:
        """Flag what was rejected or late, and decide the slices it closed."""
        counters = self.counters
        counters.records = self.stage1.records
        flags = [(rejection.reason, rejection.detail) for rejection in ingested.rejections] + [
            ("late", f"ts {ts:.3f} is behind the slices its source has closed: folded into the oldest open slice")
            for ts in ingested.late]
        if first_line is None:
            for reason, detail in flags:
                counters.flag(reason, detail)
        else:
            at = list(ingested.rejected_at) + list(ingested.late_at)
            for i in sorted(range(len(flags)), key=at.__getitem__):
                counters.flag(*flags[i], line=first_line + at[i] + 1)
        return self._drain(ingested.closed)

    def finish(self) -> list[Decision]:
        """End of input, when the one source goes idle for good: close and decide every open slice."""
        decided = self._drain(self.ingest.release())
        decided += self._emit(self.stage2.flush())
        return decided

    def _drain(self, batches) -> list[Decision]:
        decided: list[Decision] = []
        for batch in batches:
            decided += self._emit(self.stage2.add(batch))
        return decided

    def _emit(self, outputs: list[SliceOutput]) -> list[Decision]:
        decided: list[Decision] = []
        for output in outputs:
            self.counters.slices += 1
            self.counters.late_records += output.late_records
            decided += [action.decision for action in output.actions]
            for sink in self.sinks:
                sink(output)
        self.decisions.extend(decided)
        self.counters.decisions += len(decided)
        return decided
