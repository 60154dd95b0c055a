"""The one way into stage 1: decode, clock check, count, fold, close."""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence, Union

from specwatch.schemas import Rejection, RejectionCounter, TelemetryRecord, decode_line
from specwatch.schemas.step_block import StepBlock

from .combine import Stage1
from .slice_batch import SliceBatch

__all__ = ["Decoded", "Decoder", "IdleRule", "Ingest", "Ingested"]

Decoded = Union[TelemetryRecord, Rejection]
# One payload (a JSON line, an OTLP request) to what it holds: one item, a list of them
# (an OTLP request), or None (a blank line: nothing).
Decoder = Callable[[Union[bytes, str]], Union[Decoded, list, None]]


class Ingested(NamedTuple):
    """What one payload (or one run of decoded records) did, in record order within each field."""

    rejections: Sequence[Rejection]  # records not folded (already counted in `Ingest.rejected`)
    late: Sequence[float]  # event times of records folded into a later slice than their own
    closed: Sequence[SliceBatch]  # slices the records let stage 1 close, for stage 2
    # the batch mode (`Ingest.block`): the position in its input of each rejection and late record
    rejected_at: Sequence[int] = ()
    late_at: Sequence[int] = ()


_NOTHING = Ingested((), (), ())


class IdleRule:
    """When a source stops holding stage 2 back: the one idle-source rule of both paths.

    >>> rule = IdleRule(10.0)
    >>> rule.heard("t/0", now=100.0)
    >>> rule.idle(109.0), rule.idle(110.0, waiting={"t/0"}), rule.idle(110.0), rule.idle(500.0)
    ([], [], ['t/0'], [])
    >>> rule.heard("t/0", now=600.0); rule.idle(610.0)
    ['t/0']
    """

    def __init__(self, silence_seconds: float) -> None:
        self.silence_seconds = silence_seconds
        self._heard: dict[str, float] = {}
        self._idle: set[str] = set()

    def heard(self, source: str, now: float) -> None:
        """``source`` sent something (or was taken over) at ``now``."""
        self._heard[source] = now
        self._idle.discard(source)

    def silent(self, now: float) -> list[str]:
        """The sources silent long enough to be idle unless they have something left to read, in order."""
        return sorted(source for source, at in self._heard.items()
                      if source not in self._idle and now - at >= self.silence_seconds)

    def idle(self, now: float, waiting: Iterable[str] = ()) -> list[str]:
        """The sources that went idle since the last call, in order."""
        waiting = set(waiting)
        due = [source for source in self.silent(now) if source not in waiting]
        self._idle.update(due)
        return due

    def forget(self, source: str) -> None:
        self._heard.pop(source, None)
        self._idle.discard(source)


class Ingest:
    """One source's way into stage 1: decode, clock check, count, fold, close.

    >>> from specwatch.schemas import Policy
    >>> ingest = Ingest(Stage1(Policy(), source="w1"))
    >>> step = ('{"kind":"step","v":1,"ts":%s,"worker":"w1","seq":%d,"bundle_id":"b","draft_ms":1.0,'
    ...         '"verify_ms":9.0,"kv_usage":0.5,"requests":[{"id":"r","bucket":"chat","cohort":"main",'
    ...         '"drafted":4,"accepted":3}]}')
    >>> [[(b.slice_index, len(b.partials)) for b in ingest(step % (ts, seq)).closed]
    ...  for seq, ts in enumerate((10.0, 10.5, 13.0, 13.5, 14.0))]
    [[], [], [(8, 0)], [], [(10, 2)]]
    >>> ingest(step % (13.5, 3)).rejections[0].reason, ingest(b"{").rejections[0].reason
    ('duplicate', 'invalid_json')
    >>> ingest(step % (10.2, 7)).late, ingest("").closed, ingest.rejected.as_dict()
    ([10.2], (), {'duplicate': 1, 'invalid_json': 1})

    A block of the same lines gives the same, each rejection and late record by its position:

    >>> from specwatch.schemas.lines_block import decode_lines_block
    >>> block = Ingest(Stage1(Policy(), source="w1"))
    >>> lines = [step % (ts, seq) for seq, ts in enumerate((10.0, 10.5, 13.0, 13.5, 14.0))]
    >>> done = block.block(decode_lines_block([*lines, step % (13.5, 3), "{", step % (10.2, 7)]))
    >>> [(b.slice_index, len(b.partials)) for b in done.closed], done.rejected_at, done.late_at, done.late
    ([(8, 0), (10, 2)], [5, 6], [7], [10.2])
    >>> block.rejected.as_dict() == ingest.rejected.as_dict()
    True
    """

    __slots__ = ("stage", "decode", "rejected")

    def __init__(self, stage: Stage1, decode: Decoder = decode_line) -> None:
        self.stage = stage
        self.decode = decode
        self.rejected = RejectionCounter()

    def to_state(self) -> dict:
        return {"rejected": dict(self.rejected.by_reason)}

    def load_state(self, state: dict) -> None:
        self.rejected.by_reason.clear()
        self.rejected.by_reason.update({str(reason): int(n) for reason, n in state["rejected"].items()})

    def __call__(self, payload: bytes | str, now: float | None = None,
                 seen: dict[str, float] | None = None) -> Ingested:
        """Decode one payload and fold every record it holds (see `records`)."""
        decoded = self.decode(payload)
        if decoded is None:
            return _NOTHING
        return self.records(decoded if type(decoded) is list else (decoded,), now, seen)

    def records(self, items: Iterable[Decoded], now: float | None = None,
                seen: dict[str, float] | None = None,
                on_closed: Callable[[list[SliceBatch]], object] | None = None) -> Ingested:
        """Fold decoded records in order (counting rejections), closing what each makes ready."""
        stage = self.stage
        rejections: list[Rejection] = []
        late: list[float] = []
        closed: list[SliceBatch] = []
        for item in stage.prime(items, now):
            rejection, is_late = stage.take(item, now)
            if rejection is not None:
                self.rejected.add(rejection)
                rejections.append(rejection)
                continue
            if is_late:
                late.append(item.ts)
            if seen is not None and item.kind != "shadow":
                seen[item.worker] = now
            ready = stage.close_ready()
            if ready:
                if on_closed is None:
                    closed += ready
                else:
                    on_closed(ready)
        if not (rejections or late or closed):
            return _NOTHING
        return Ingested(rejections, late, closed)

    def release(self) -> list[SliceBatch]:
        """The source has gone idle, or its input ended: every open slice closes now."""
        return self.stage.close_ready(final=True)

    def block(self, block: StepBlock, now: float | None = None, seen: dict[str, float] | None = None) -> Ingested:
        """The batch mode: a block (`decode_lines_block`, `request_block`) folded at once."""
        rejected, late, closed = self.stage.fold_block(block, now)
        for _, rejection in rejected:
            self.rejected.add(rejection)
        if seen is not None:
            refused = {position for position, _ in rejected}
            for position, worker in zip(block.at, block.workers):
                if position not in refused:
                    seen[worker] = now
            for position, item in block.others:
                if position not in refused and item.kind != "shadow":
                    seen[item.worker] = now
        if not (rejected or late or closed):
            return _NOTHING
        return Ingested([r for _, r in rejected], [ts for _, ts in late], closed,
                        [p for p, _ in rejected], [p for p, _ in late])
