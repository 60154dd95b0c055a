"""A seeded fleet of speculative-decoding engine workers with scripted incidents: contract-v1
records in event-time order plus the ground truth, a pure function of the seed.

The fleet runs one `worker` per engine on its share of a `scenarios` schedule, over the numbers
of the `engine_model`, and merges the workers' records in event time; the simulation's public
names are all importable from here."""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Iterator, Protocol, Sequence

import numpy as np

from specwatch.collectors.capture import SampleCapture
from specwatch.schemas import BundleCard, TelemetryRecord, bundle_digest
# The engine model's and the scenarios' public names are the simulation's too: its callers import them from here.
from specwatch.lab.simulation.engine_model import (BUCKETS, COHORTS, DEFAULT_CARD, BucketProfile, acceptance_length,
                                                   bucket_acceptance_length, step_timing, true_speedup)
from specwatch.lab.simulation.scenarios import (EXPECTED_REASON, INTENSITY, SCENARIO_SPECS, SCENARIOS, Incident,
                                                IncidentPlan, changed_card, checked_plan, kv_pressure_workers)
from specwatch.lab.simulation.worker import SimulatedWorker, worker_name

__all__ = ["BUCKETS", "COHORTS", "DEFAULT_CARD", "DEFAULT_START_TS", "SCENARIOS", "BucketProfile",
           "FlagSource", "Incident", "IncidentPlan", "Simulator", "acceptance_length", "bucket_acceptance_length",
           "step_timing", "true_speedup"]

DEFAULT_START_TS = 1_767_225_600.0  # 2026-01-01T00:00:00Z

_DEFAULT_CONCURRENCY = 16
_DEFAULT_WORKERS = 8
_ROLLOUT_SECONDS = 10.0  # a card change rolls over the fleet in this long


class FlagSource(Protocol):
    """What the simulated engines ask before drafting, like `specwatch.actions.flags.FlagStore`:
    ``lookup`` answers with ``enabled`` and ``draft_limit``, like ``SpeculationState``."""

    def lookup(self, bundle_id: str, bucket: str, cohort: str): ...


# -- the fleet ------------------------------------------------------------------------------


class Simulator:
    """A seeded fleet of speculative engine workers running one of `SCENARIOS`.

    ``intensity`` is the strength of a single-incident scenario's incident, in its kind's unit;
    ``flags`` (a `FlagSource`) closes the loop so that fallback decisions take effect;
    ``concurrency`` is the mean running requests per worker; a ``capture`` seals the token ids
    of the requests it takes into their samples.

    >>> sim = Simulator("acceptance_drop", seed=1, minutes=0.05)
    >>> [i.kind for i in sim.incidents], sim.bundle_cards == {sim.initial_bundle_id: DEFAULT_CARD}
    ([], True)
    >>> sim = Simulator("acceptance_drop", seed=1)
    >>> incident = sim.incidents[0]
    >>> incident.bucket, incident.expected_reason, incident.start_ts - sim.start_ts
    ('coding', 'acceptance_drop', 240.0)
    >>> Simulator("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown scenario 'nope'; choose one of: healthy, acceptance_drop, ...
    """

    def __init__(self, scenario: str = "demo", seed: int = 7, minutes: float | None = None,
                 workers: int = _DEFAULT_WORKERS, intensity: float | None = None, flags: FlagSource | None = None,
                 start_ts: float = DEFAULT_START_TS, incident_at: float | None = None,
                 concurrency: int = _DEFAULT_CONCURRENCY, capture: SampleCapture | None = None,
                 plans: Sequence[IncidentPlan] | None = None) -> None:
        if scenario not in SCENARIO_SPECS:
            raise ValueError(f"unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIO_SPECS)}")
        spec = SCENARIO_SPECS[scenario]
        if plans is not None:  # incidents of the caller's choosing on the scenario's traffic
            spec = replace(spec, plans=tuple(checked_plan(plan) for plan in plans))
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        minutes = spec.minutes if minutes is None else float(minutes)
        if not (minutes > 0 and math.isfinite(minutes)):
            raise ValueError(f"minutes must be a positive number, got {minutes!r}")
        if not 1 <= int(workers) <= 4096:
            raise ValueError(f"workers must be between 1 and 4096, got {workers!r}")
        if not 1 <= int(concurrency) <= 1024:
            raise ValueError(f"concurrency must be between 1 and 1024 running requests, got {concurrency!r}")
        if not (isinstance(start_ts, (int, float)) and start_ts >= 0 and math.isfinite(start_ts)):
            raise ValueError(f"start_ts must be a non-negative unix time, got {start_ts!r}")
        if incident_at is not None and not (incident_at >= 0 and math.isfinite(incident_at)):
            raise ValueError(f"incident_at must be seconds >= 0 after start, got {incident_at!r}")
        if intensity is not None:
            if len(spec.plans) != 1:
                raise ValueError(f"scenario {scenario!r} has {len(spec.plans)} incidents; intensity applies "
                                 "only to scenarios with exactly one")
            kind = spec.plans[0].kind
            _, low, high, meaning = INTENSITY[kind]
            if not low <= intensity <= high:
                raise ValueError(f"intensity for {kind} is the {meaning}; it must be in [{low}, {high}], "
                                 f"got {intensity!r}")
        if flags is not None and not callable(getattr(flags, "lookup", None)):
            raise ValueError("flags must have a lookup(bundle_id, bucket, cohort) method, like FlagStore")
        self.scenario = scenario
        self.seed = seed
        self.minutes = minutes
        self.workers = int(workers)
        self.intensity = intensity
        self.flags = flags
        self.start_ts = float(start_ts)
        self.incident_at = spec.incident_at if incident_at is None else float(incident_at)
        self.concurrency = int(concurrency)
        self.capture = capture
        self._scenario = spec

    @property
    def duration(self) -> float:
        """Event time covered, in seconds."""
        return self.minutes * 60.0

    @property
    def end_ts(self) -> float:
        return self.start_ts + self.duration

    @property
    def initial_bundle_id(self) -> str:
        return bundle_digest(DEFAULT_CARD)

    def _intensity(self, plan: IncidentPlan) -> float:
        if plan.intensity is not None:
            return plan.intensity
        return INTENSITY[plan.kind][0] if self.intensity is None else self.intensity

    def _schedule(self) -> list[list[tuple[float, IncidentPlan]]]:
        """Per worker: (seconds after start, incident) in time order, only those inside the run."""
        per_worker: list[list[tuple[float, IncidentPlan]]] = [[] for _ in range(self.workers)]
        surge = set(kv_pressure_workers(self.workers))
        for plan in self._scenario.plans:
            start = self.incident_at + plan.offset
            for w in range(self.workers):
                at = start
                if plan.kind in ("target_update", "bundle_change"):
                    at = start + _ROLLOUT_SECONDS * w / self.workers
                elif plan.kind == "kv_pressure" and w not in surge:
                    continue
                if at < self.duration:
                    per_worker[w].append((at, plan))
        for items in per_worker:
            items.sort(key=lambda item: item[0])
        return per_worker

    @property
    def incidents(self) -> list[Incident]:
        """Ground truth: the incidents that start inside the run, in start order."""
        out = []
        base = self.initial_bundle_id
        for plan in self._scenario.plans:
            start = self.incident_at + plan.offset
            if start >= self.duration:
                continue
            bundle_id, workers = base, ()
            if plan.kind in ("target_update", "bundle_change"):
                bundle_id = bundle_digest(changed_card(DEFAULT_CARD, plan.kind))
            elif plan.kind == "kv_pressure":
                workers = tuple(worker_name(w) for w in kv_pressure_workers(self.workers))
            out.append(Incident(plan.kind, self.start_ts + start, bundle_id, plan.bucket, plan.cohort,
                                EXPECTED_REASON[plan.kind], workers))
        return sorted(out, key=lambda i: i.start_ts)

    @property
    def bundle_cards(self) -> dict[str, BundleCard]:
        """Every bundle the run announces: bundle_id -> fingerprint card."""
        cards = {self.initial_bundle_id: DEFAULT_CARD}
        for incident in self.incidents:
            if incident.kind in ("target_update", "bundle_change"):
                cards[incident.bundle_id] = changed_card(DEFAULT_CARD, incident.kind)
        return cards

    def records(self) -> Iterator[TelemetryRecord]:
        """Contract-v1 records of the whole fleet in event-time order (equal times in worker order,
        then in the order a worker made them); a fresh run per call."""
        heap: list[tuple[float, int, int, list, Iterator | None]] = []
        counter = 0

        def emit_later(ts: float, rank: int, records: list) -> None:
            nonlocal counter
            counter += 1
            heapq.heappush(heap, (ts, rank, counter, records, None))

        seeds = np.random.SeedSequence(self.seed).spawn(self.workers)
        schedule = self._schedule()
        for w in range(self.workers):
            worker = SimulatedWorker(w, self, np.random.default_rng(seeds[w]), schedule[w], emit_later)
            stream = worker.run()
            ts, batch = next(stream)
            counter += 1
            heap.append((ts, w, counter, batch, stream))
        heapq.heapify(heap)
        end_ts = self.end_ts
        while heap:
            ts, rank, _, batch, stream = heap[0]
            if ts > end_ts:
                return
            if stream is None:
                heapq.heappop(heap)
            else:
                next_ts, following = next(stream)
                counter += 1
                heapq.heapreplace(heap, (next_ts, rank, counter, following, stream))
            if len(batch) == 1:
                yield batch[0]
            else:
                yield from batch
