"""Stage 1's hot path for step records decoded as columns: same tallies, no per-round objects.

`fold_step` is `Stage1.add` for a `StepColumns`; `FastPipeline` is the embedded pipeline
reading through the fast decoders (the Faust stage-1 task uses `fold_record` too). They
give the same slices, partials and decisions as the reference paths (tests/test_fastpath.py).
"""

from __future__ import annotations

from specwatch.schemas import Rejection
from specwatch.schemas.fastdecode import StepColumns, decode_line_fast, decode_request_fast

from .embedded import EmbeddedPipeline
from .topology import SliceBatch, Stage1, fold_step_times

__all__ = ["FastPipeline", "fold_step", "fold_record"]


def fold_step(stage: Stage1, step: StepColumns) -> Rejection | None:
    """Fold one step into ``stage`` exactly as ``stage.add(step.record())`` would."""
    ts = step.ts
    rejection = stage.admit("step", ts, (step.worker, step.seq))
    if rejection is not None:
        return rejection
    batch: SliceBatch = stage._slice(ts)
    bundle = step.bundle_id
    batch.sighted(bundle, step.worker, ts)
    tallies = batch.round_tallies
    tokens: dict = {}
    # the tally keeps first-seen order, so keys (and their partials) appear in the order
    # the reference loop meets them
    for (bucket, cohort, drafted, accepted), n in step.rounds.items():
        key = (bundle, bucket, cohort)
        tally = tallies.get(key)
        if tally is None:
            tally = tallies[key] = {}
        pair = (drafted, accepted)
        tally[pair] = tally.get(pair, 0) + n
        drafted_accepted = tokens.get(key)
        if drafted_accepted is None:
            tokens[key] = [drafted * n, accepted * n]
        else:
            drafted_accepted[0] += drafted * n
            drafted_accepted[1] += accepted * n
    fold_step_times(batch, bundle, tokens, step, step.draft_ms, step.verify_ms, step.kv_usage, ts)
    return None


def fold_record(stage: Stage1, record) -> Rejection | None:
    """`Stage1.add` for either a `StepColumns` or a reference record."""
    if type(record) is StepColumns:
        return fold_step(stage, record)
    return stage.add(record)


class FastPipeline(EmbeddedPipeline):
    """`EmbeddedPipeline` reading JSON Lines through `decode_line_fast`."""

    def feed_line(self, line: str | bytes):
        self.counters.lines += 1
        record = decode_line_fast(line)
        if record is None:
            return []
        if type(record) is StepColumns:
            if self._ahead_of_clock(record.ts):
                return []
            return self._fold(fold_step, record)
        if isinstance(record, Rejection):
            self.reject(record)
            return []
        return self.feed(record)

    def feed_otlp(self, payload: bytes):
        """Every record of one OTLP ExportLogsServiceRequest; rejections are counted."""
        decided = []
        for record in decode_request_fast(payload):
            if isinstance(record, Rejection):
                self.reject(record)
                continue
            if self._ahead_of_clock(record.ts):
                continue
            decided += self._fold(fold_record, record)
        return decided
