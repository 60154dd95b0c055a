"""The message from stage 1 to stage 2: what one source folded into one slice (`SliceBatch`),
partial aggregates per scope and the discrete events, as plain data for a checkpoint or the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from specwatch.schemas.slice_stats import SliceStats, held_sample
from specwatch.schemas import StepRecord
from specwatch.schemas.scope import Scope as Key, scope_from_text, scope_text

__all__ = ["SliceBatch"]


@dataclass
class SliceBatch:
    """What one source contributes to one slice: partial aggregates and discrete events."""

    source: str
    slice_index: int
    watermark: int
    partials: dict[Key, SliceStats] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    late_records: int = 0
    round_tallies: dict[Key, dict[tuple[int, int], int]] = field(default_factory=dict, repr=False)
    # (bundle_id, worker) -> [first, last] event time this slice saw the worker run the bundle;
    # turned into one "sighting" event per pair when the slice closes.
    sightings: dict[tuple[str, str], list[float]] = field(default_factory=dict, repr=False)
    # per key: [(rank, step) of its lowest-acceptance step, (rank, step) of its step control] so far
    step_candidates: dict[Key, list[tuple]] = field(default_factory=dict, repr=False)

    def to_state(self) -> dict:
        """The slice as plain data, held steps built now (`from_state` reads it back)."""
        return {"source": self.source, "slice_index": self.slice_index, "watermark": self.watermark,
                "partials": [[list(key), stats.to_state()] for key, stats in self.partials.items()],
                "events": self.events, "late_records": self.late_records,
                "round_tallies": [[list(key), [[d, a, n] for (d, a), n in tally.items()]]
                                  for key, tally in self.round_tallies.items()],
                "sightings": [[bundle, worker, span] for (bundle, worker), span in self.sightings.items()],
                "step_candidates": [[list(key), [None if held is None else [list(held[0]), step_as_json(held[1])]
                                                 for held in pair]] for key, pair in self.step_candidates.items()]}

    @classmethod
    def from_state(cls, state: dict) -> "SliceBatch":
        def key(items) -> Key:
            return tuple(items)

        def held(item) -> tuple | None:
            return None if item is None else (tuple(item[0]), StepRecord.model_validate(item[1]))

        return cls(str(state["source"]), int(state["slice_index"]), int(state["watermark"]),
                   partials={key(k): SliceStats.from_state(v) for k, v in state["partials"]},
                   events=[dict(event) for event in state["events"]], late_records=int(state["late_records"]),
                   round_tallies={key(k): {(int(d), int(a)): int(n) for d, a, n in tally}
                                  for k, tally in state["round_tallies"]},
                   sightings={(str(b), str(w)): [float(span[0]), float(span[1])] for b, w, span in state["sightings"]},
                   step_candidates={key(k): [held(item) for item in pair] for k, pair in state["step_candidates"]})

    def sighted(self, bundle_id: str, worker: str, ts: float) -> None:
        """A record of ``worker`` running ``bundle_id`` at ``ts`` (a step or a bundle card)."""
        span = self.sightings.get((bundle_id, worker))
        if span is None:
            self.sightings[(bundle_id, worker)] = [ts, ts]
        elif ts < span[0]:
            span[0] = ts
        elif ts > span[1]:
            span[1] = ts

    def tally(self, key: Key, pair: tuple[int, int], n: int) -> None:
        """``n`` more rounds of ``key`` that drafted and accepted ``pair``."""
        tally = self.round_tallies.setdefault(key, {})
        tally[pair] = tally.get(pair, 0) + n

    def hold_step(self, key: Key, lowest: tuple | None, control: tuple) -> None:
        """Keep the (rank, step) pairs ranked first for ``key``: lowest acceptance, control."""
        held = self.step_candidates.get(key)
        if held is None:
            self.step_candidates[key] = [lowest, control]
            return
        if lowest is not None and (held[0] is None or lowest[0] < held[0][0]):
            held[0] = lowest
        if control[0] < held[1][0]:
            held[1] = control

    def seal(self) -> None:
        """As the slice closes: the round tallies into the partials (and the bundle totals), the
        samples among its steps kept, its sightings as one event per (bundle, worker)."""
        if self.step_candidates:
            _keep_step_samples(self.partials, self.step_candidates)
            self.step_candidates = {}
        for key, tally in self.round_tallies.items():
            self.partials[key].add_round_counts(tally)
            whole = self.partials[(key[0], None, None)]
            for (drafted, accepted), n in tally.items():
                if drafted:
                    whole.rounds += n
                    whole.drafted_tokens += drafted * n
                    whole.accepted_tokens += accepted * n
                else:
                    whole.plain_entries += n
        self.round_tallies = {}
        for (bundle_id, worker), (first, last) in sorted(self.sightings.items()):
            self.events.append({"type": "sighting", "ts": last, "first_seen": first,
                                "worker": worker, "bundle_id": bundle_id})
        self.sightings = {}

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "slice_index": self.slice_index,
            "watermark": self.watermark,
            "partials": {scope_text(k): v.to_dict() for k, v in self.partials.items()},
            "events": self.events,
            "late_records": self.late_records,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SliceBatch":
        return cls(
            source=data["source"],
            slice_index=int(data["slice_index"]),
            watermark=int(data["watermark"]),
            partials={scope_from_text(k): SliceStats.from_dict(v) for k, v in data.get("partials", {}).items()},
            events=list(data.get("events", [])),
            late_records=int(data.get("late_records", 0)),
        )


def _keep_step_samples(partials: dict[Key, SliceStats], candidates: dict[Key, list[tuple]]) -> None:
    """Each key's lowest-acceptance step and step control among a slice's steps, ranked by content."""
    for key, (lowest, control) in candidates.items():
        samples = partials[key].samples
        if "lowest_acceptance" in samples or "control_step" in samples:
            stats = partials[key]
            if lowest is not None:
                stats.keep_samples("lowest_acceptance", [lowest], step_as_json)
            stats.keep_samples("control_step", [control], step_as_json)
            continue
        # the key's first step samples (every slice's own, unless a checkpoint held some): each
        # one as `SliceStats.keep_samples` keeps the first of its kind
        if lowest is not None:
            samples["lowest_acceptance"] = [held_sample(*lowest, step_as_json)]
        samples["control_step"] = [held_sample(*control, step_as_json)]


def step_as_json(step) -> dict:
    return (step if isinstance(step, StepRecord) else step()).model_dump(mode="json")

