"""The overlap suite: seeded runs of two to four incidents at once (bucket, cohort and fleet-wide),
each scored on its own decision against the same incident alone and its information bound."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from specwatch.actions.flags import FlagStore
from specwatch.detectors.monitor import KeyMonitor
from specwatch.schemas import Policy, RequestRecord, StepRecord
from specwatch.lab.simulation.simulator import IncidentPlan, Simulator
from specwatch.streams.embedded import EmbeddedPipeline

from .bounds import information_bound
from .scoring import Alarm, decision_alarm, judge, stray_alarms
from .suite import pooled

__all__ = ["KINDS", "PATTERNS", "OverlapRun", "format_overlap", "overlap_runs", "quick_overlap_runs", "run_overlap",
           "run_overlap_suite", "summarize_overlap"]

# The incidents combined, each where its own scenario puts it: two buckets, a bucket's cohort
# and the whole fleet. Each kind has a bucket of its own, so every decision has one right cause.
KINDS = {
    "acceptance_drop": IncidentPlan("acceptance_drop", "coding", intensity=0.4),
    "quality_mismatch": IncidentPlan("quality_mismatch", "structured", intensity=0.5),
    "latency_tail": IncidentPlan("latency_tail", "reasoning", "main", intensity=5.0),
    "error_burst": IncidentPlan("error_burst", "extraction", intensity=20.0),
    "kv_pressure": IncidentPlan("kv_pressure", intensity=0.6),
}
# Kinds decided within seconds: the first of a "during another's fallback" run is one of them.
_QUICK_KINDS = ("acceptance_drop", "quality_mismatch", "kv_pressure")
# How the incidents of a run start: at once, 20 s apart, or all but the first once the first's
# fallback has begun (10 s after it: KV has lowered D, which it switches off 15 s later;
# acceptance has lowered D in coding; structured is off).
PATTERNS = ("together", "staggered", "during_fallback")
_STAGGER_SECONDS = 20.0
_AFTER_FALLBACK_SECONDS = 10.0
LEVELS = ((8, 16), (2, 8))
# As in the single-incident suite: incidents once the longest learning is over.
_INCIDENT_AT = {(8, 16): 90.0, (2, 8): 300.0}
# How long the last incident is watched: the slowest kind (a 10 % tail, errors x20) at each level.
_WATCH_SECONDS = {(8, 16): 240.0, (2, 8): 420.0}
# Delay against the incident alone: 2x, or within one slice and its lateness (a ratio of two
# delays of a second or two says nothing).
_ALONE_FACTOR = 2.0
_ALONE_SLACK_SECONDS = 2.0
_FULL_RUNS = 40
# An incident that began with speculation already off over its whole scope (closed loop).
MASKED = "masked"
_FIRST_SEED = 100


@dataclass(frozen=True)
class OverlapRun:
    """One seeded overlap run: which incidents, how they start, the loop and the fleet."""

    seed: int
    kinds: tuple[str, ...]
    pattern: str
    closed_loop: bool
    workers: int = 8
    concurrency: int = 16

    @property
    def level(self) -> tuple[int, int]:
        return self.workers, self.concurrency

    @property
    def name(self) -> str:
        loop = "closed" if self.closed_loop else "open"
        return f"{'+'.join(self.kinds)}/{self.pattern}/{loop}/w{self.workers}c{self.concurrency}/s{self.seed}"

    def plans(self) -> list[IncidentPlan]:
        """The incidents with their offsets after the run's incident start."""
        out = []
        for i, kind in enumerate(self.kinds):
            offset = {"together": 0.0, "staggered": _STAGGER_SECONDS * i,
                      "during_fallback": 0.0 if i == 0 else _AFTER_FALLBACK_SECONDS}[self.pattern]
            out.append(replace(KINDS[kind], offset=offset))
        return out

    def alone(self, kind: str) -> "OverlapRun":
        """The same run (seed, fleet, loop) with only ``kind``, at the run's incident start: its
        reference delay."""
        return replace(self, kinds=(kind,), pattern="together")


def overlap_runs(count: int = _FULL_RUNS, first_seed: int = _FIRST_SEED) -> list[OverlapRun]:
    """``count`` seeded runs; the seed draws two to four kinds, the pattern, the loop and the fleet.

    >>> [r.name for r in overlap_runs(2)]  # doctest: +NORMALIZE_WHITESPACE
    ['quality_mismatch+latency_tail+error_burst+acceptance_drop/during_fallback/open/w2c8/s100',
     'quality_mismatch+acceptance_drop/during_fallback/open/w2c8/s101']
    """
    runs = []
    for seed in range(first_seed, first_seed + count):
        rng = np.random.default_rng(seed)
        size = int(rng.integers(2, 5))
        pattern = PATTERNS[int(rng.integers(len(PATTERNS)))]
        kinds = [str(k) for k in rng.permutation(list(KINDS))[:size]]
        if pattern == "during_fallback" and kinds[0] not in _QUICK_KINDS:
            quick = next((k for k in kinds if k in _QUICK_KINDS), None)
            if quick is None:
                kinds[0] = str(rng.choice([k for k in _QUICK_KINDS if k not in kinds]))
            else:
                kinds.remove(quick)
                kinds.insert(0, quick)
        closed = bool(rng.integers(2))
        workers, concurrency = LEVELS[int(rng.integers(len(LEVELS)))]
        runs.append(OverlapRun(seed, tuple(kinds), pattern, closed, workers, concurrency))
    return runs


def quick_overlap_runs() -> list[OverlapRun]:
    """A small fixed subset for tests: the demo's pair, an error burst whose evidence a fleet-wide
    KV fallback cuts short (closed loop), and a tail with an acceptance drop started together
    (open loop)."""
    return [OverlapRun(7, ("error_burst", "kv_pressure"), "staggered", True),
            OverlapRun(8, ("latency_tail", "acceptance_drop"), "together", False)]


def _simulator(run: OverlapRun, flags: FlagStore | None, minutes: float) -> Simulator:
    return Simulator("healthy", seed=run.seed, minutes=minutes, workers=run.workers,
                     concurrency=run.concurrency, flags=flags, incident_at=_INCIDENT_AT[run.level],
                     plans=run.plans())


def run_overlap(run: OverlapRun, policy: Policy | None = None) -> dict:
    """One run: the verdict, delay and bound of each incident, and the decisions no incident
    explains; it stops once every incident has a right decision."""
    started = time.monotonic()
    policy = policy or Policy()
    start = _INCIDENT_AT[run.level]
    last = max(p.offset for p in run.plans())
    minutes = (start + last + _WATCH_SECONDS[run.level]) / 60.0
    flags = FlagStore() if run.closed_loop else None
    sim = _simulator(run, flags, minutes)
    incidents = sim.incidents
    alarms: list[Alarm] = []
    lateness = policy.windows.lateness_seconds

    covered: dict[int, dict] = {}  # incident index -> its evidence when another cause's fallback covered it

    def released(output) -> None:
        for action in output.actions:
            d = action.decision
            alarms.append(decision_alarm(d, max(d.ts, output.slice_end + lateness)))
        # after the whole slice: a last look at the fallback may have decided the incident
        for d in (action.decision for action in output.actions if action.decision.action == "disable_speculation"):
            for i, incident in enumerate(incidents):
                if i not in covered and _covers(d, incident) and judge(incident, alarms).verdict != "right":
                    covered[i] = _evidence_at_cover(pipeline.stage2.decider, d, incident)

    pipeline = EmbeddedPipeline(policy, flags=flags, sinks=[released])
    first_start = min(i.start_ts for i in incidents)
    keys = {(i.bucket, i.cohort or "main") for i in incidents if i.bucket is not None}
    requests = {key: 0 for key in keys}
    rounds = {key: 0 for key in keys}
    decode: dict = {key: [] for key in keys}
    last_ts = sim.start_ts
    judged = 0  # alarms already judged: a run stops once every incident has a right one
    for record in sim.records():
        last_ts = record.ts
        if record.ts < first_start:
            if isinstance(record, RequestRecord) and (record.bucket, record.cohort) in requests:
                requests[(record.bucket, record.cohort)] += 1
                if record.e2e_ms is not None and record.ttft_ms is not None:  # how long a stall holds it back
                    decode[(record.bucket, record.cohort)].append((record.e2e_ms - record.ttft_ms) / 1000.0)
            elif isinstance(record, StepRecord):
                for entry in record.requests:
                    if entry.drafted and (entry.bucket, entry.cohort) in rounds:
                        rounds[(entry.bucket, entry.cohort)] += 1
        pipeline.feed(record)
        if len(alarms) != judged:
            judged = len(alarms)
            if all(judge(i, alarms).verdict == "right" for i in incidents):
                break
    pipeline.finish()
    before = first_start - sim.start_ts
    rows = []
    for index, incident in enumerate(incidents):
        verdict = judge(incident, alarms)
        alarm = verdict.alarm
        if verdict.verdict != "right" and run.closed_loop and _masked(incident, alarms):
            verdict = replace(verdict, verdict=MASKED)
        row = {"kind": incident.kind, "bucket": incident.bucket, "cohort": incident.cohort,
               "start_s": round(incident.start_ts - sim.start_ts, 1), "expected_reason": incident.expected_reason,
               "verdict": verdict.verdict, "delay_s": verdict.delay_s,
               "reason": alarm.reason if alarm else None,
               "scope": f"{alarm.bucket or '*'}/{alarm.cohort or '*'}" if alarm else None}
        key = (incident.bucket, incident.cohort or "main")
        if key in requests:
            plan = KINDS[incident.kind]
            observed = rounds[key] if incident.kind == "acceptance_drop" else requests[key]
            bound = information_bound(incident.kind, plan.intensity, observed / before,
                                      _budget(policy, incident.kind), incident.bucket, decode[key],
                                      rounds_per_request=rounds[key] / requests[key] if requests[key] else None)
            row["bound_s"] = bound["seconds"] if bound else None
        bound = row.get("bound_s")
        # as in the single-incident tables: a ratio only where the bound is above the slice
        measured = bound and bound > policy.windows.slice_seconds and row["delay_s"] is not None
        row["x_bound"] = round(row["delay_s"] / bound, 2) if measured else None
        row.update(alone_s=None, alone_verdict=None, within_alone=None)  # `run_overlap_suite` compares
        row["covered"] = covered.get(index)
        rows.append(row)
    stray = stray_alarms(incidents, alarms)
    return {"run": run.name, "seed": run.seed, "kinds": list(run.kinds), "pattern": run.pattern,
            "closed_loop": run.closed_loop, "workers": run.workers, "concurrency": run.concurrency,
            "incidents": rows, "unexplained": [a.to_dict() for a in stray],
            "simulated_seconds": round(last_ts - sim.start_ts, 1), "wall_seconds": round(time.monotonic() - started, 2)}


def _covers(decision, incident) -> bool:
    """Whether ``decision`` switches the incident's key off for another cause after it began.

    >>> from types import SimpleNamespace as I
    >>> tail = I(start_ts=100.0, bundle_id="b-1", bucket="reasoning", cohort="main", expected_reason="latency_slo")
    >>> kv = dict(ts=110.0, bundle_id="b-1", bucket=None, cohort=None, reason="kv_pressure")
    >>> later, same = I(**{**kv, "ts": 90.0}), I(**{**kv, "reason": "latency_slo"})
    >>> _covers(I(**kv), tail), _covers(same, tail), _covers(later, tail)
    (True, False, False)
    """
    return (incident.bucket is not None and decision.ts >= incident.start_ts
            and decision.reason != incident.expected_reason and decision.bundle_id == incident.bundle_id
            and decision.bucket in (None, incident.bucket) and decision.cohort in (None, incident.cohort or "main"))


def _evidence_at_cover(decider, decision, incident) -> dict:
    """What the incident's own gate held when ``decision`` (another cause's fallback) covered its
    key: the rate test's nats against its usual and last-look thresholds, or the shadow checks
    and strict mismatches of its bucket, or the acceptance gate's breaching windows."""
    bundle, bucket, cohort = incident.bundle_id, incident.bucket, incident.cohort or "main"
    out = {"by": decision.reason, "scope": f"{decision.bucket or '*'}/{decision.cohort or '*'}",
           "after_s": round(decision.ts - incident.start_ts, 1)}
    monitor = decider.monitors.get((bundle, bucket, cohort))
    if incident.kind == "quality_mismatch":
        out.update(shadow_checks=decider.shadow_counts[(bundle, bucket, "checks")],
                   strict_mismatches=decider.shadow_counts[(bundle, bucket, "mismatches")])
    elif incident.kind == "acceptance_drop" and isinstance(monitor, KeyMonitor):
        out["breaching_windows"] = monitor.acceptance_gate.streak
    elif isinstance(monitor, KeyMonitor):
        keys = sum(1 for key, m in decider.monitors.items() if isinstance(m, KeyMonitor) and key[0] == bundle
                   and decision.bucket in (None, key[1]) and decision.cohort in (None, key[2]))
        out.update(monitor.rate_evidence(keys).get(incident.expected_reason, {}))
    return out


def _masked(incident, alarms: list[Alarm]) -> bool:
    """Whether, closed loop, speculation was already off over the incident's whole scope when it
    began: every incident kind here hurts only the speculative path, so it never reached traffic.

    >>> from types import SimpleNamespace as I
    >>> burst = I(start_ts=100.0, bundle_id="b-1", bucket="extraction", cohort=None)
    >>> kv = Alarm("specwatch", 95.0, "kv_pressure", "b-1", action="disable_speculation")
    >>> _masked(burst, [kv]), _masked(burst, [replace(kv, ts=105.0)])
    (True, False)
    """
    return any(a.ts <= incident.start_ts and a.action in ("disable_speculation", "invalidate_bundle")
               and a.bundle_id == incident.bundle_id and a.bucket in (None, incident.bucket)
               and a.cohort is None for a in alarms)


def _budget(policy: Policy, kind: str) -> float:
    gate = policy.latency if kind == "latency_tail" else policy.errors
    return gate.false_alarms_per_key_hour


def _run_job(job: tuple[OverlapRun, Policy | None]) -> tuple[OverlapRun, dict]:
    run, policy = job
    return run, run_overlap(run, policy)


def run_overlap_suite(runs: Iterable[OverlapRun], policy: Policy | None = None, processes: int = 1,
                      progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every run, and each of its incidents alone (same seed, fleet, loop and start), then each
    incident's delay against its run alone; results in the order of ``runs``."""
    runs = list(runs)
    alone = sorted({r.alone(k) for r in runs for k in r.kinds if len(r.kinds) > 1}, key=lambda r: r.name)
    jobs = [(r, policy) for r in runs + alone]
    results: dict[OverlapRun, dict] = {}
    for run, result in pooled(_run_job, jobs, processes):
        results[run] = result
        if progress is not None:
            progress(result)
    out = []
    for run in runs:
        result = results[run]
        for row in result["incidents"]:
            single = results.get(run.alone(row["kind"]))
            reference = single["incidents"][0] if single else None
            row["alone_s"] = reference["delay_s"] if reference and reference["verdict"] == "right" else None
            row["alone_verdict"] = reference["verdict"] if reference else None
            row["within_alone"] = _within(row["delay_s"], row["alone_s"])
        out.append(result)
    return out


def _within(delay: float | None, alone: float | None) -> bool | None:
    """Whether an overlapped delay is at most 2x the incident's delay alone (or a slice over it).

    >>> _within(30.0, 18.0), _within(45.0, 18.0), _within(3.0, 1.0), _within(None, 5.0)
    (True, False, True, False)
    """
    if alone is None:
        return None
    if delay is None:
        return False
    return delay <= max(_ALONE_FACTOR * alone, alone + _ALONE_SLACK_SECONDS)


def summarize_overlap(results: list[dict]) -> dict:
    """Per incident kind: decided right (reason and scope), delays against alone and the bound;
    per suite: decisions no incident explains."""
    by_kind: dict[str, list[dict]] = {}
    for result in results:
        for row in result["incidents"]:
            by_kind.setdefault(row["kind"], []).append(row)
    kinds = {}
    for kind, rows in sorted(by_kind.items()):
        right = [r for r in rows if r["verdict"] == "right"]
        ratios = [r["delay_s"] / r["alone_s"] for r in right if r["alone_s"]]
        bounds = [r["x_bound"] for r in right if r["x_bound"] is not None]
        compared = [r for r in rows if r["within_alone"] is not None]
        kinds[kind] = {"incidents": len(rows), "right": len(right),
                       "masked": sum(1 for r in rows if r["verdict"] == MASKED),
                       "median_delay_s": _median([r["delay_s"] for r in right]),
                       "max_delay_s": max((r["delay_s"] for r in right), default=None),
                       "median_x_alone": _median(ratios), "max_x_alone": round(max(ratios), 2) if ratios else None,
                       "within_2x_alone": sum(1 for r in compared if r["within_alone"]), "compared": len(compared),
                       "median_x_bound": _median(bounds)}
    incidents = sum(len(r["incidents"]) for r in results)
    right = sum(1 for r in results for row in r["incidents"] if row["verdict"] == "right")
    runs_all_right = sum(1 for r in results if all(row["verdict"] in ("right", MASKED) for row in r["incidents"]))
    masked = sum(1 for r in results for row in r["incidents"] if row["verdict"] == MASKED)
    return {"runs": len(results), "runs_all_right": runs_all_right, "incidents": incidents, "right": right,
            "masked": masked,
            "unexplained_decisions": sum(len(r["unexplained"]) for r in results),
            "kinds": kinds, "results": results}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def format_overlap(summary: dict) -> str:
    """The overlap tables as text (Markdown)."""
    lines = [f"overlap: {summary['runs_all_right']}/{summary['runs']} runs with every incident right, "
             f"{summary['right']}/{summary['incidents'] - summary['masked']} incidents right "
             f"({summary['masked']} masked: their scope was off before they began), "
             f"{summary['unexplained_decisions']} decisions no incident explains", "",
             "| incident | right | median delay | max delay | median x alone | max x alone | within 2x alone "
             "| median x bound |", "|---|---|---|---|---|---|---|---|"]
    for kind, k in summary["kinds"].items():
        lines.append(f"| {kind} | {k['right']}/{k['incidents']} | {_s(k['median_delay_s'])} | "
                     f"{_s(k['max_delay_s'])} | {_x(k['median_x_alone'])} | {_x(k['max_x_alone'])} | "
                     f"{k['within_2x_alone']}/{k['compared']} | {_x(k['median_x_bound'])} |")
    lines += ["", "| run | incident | verdict | decision | delay | alone | x bound |", "|---|---|---|---|---|---|---|"]
    for result in summary["results"]:
        for row in result["incidents"]:
            decision = f"{row['reason']} {row['scope']}" if row["reason"] else "-"
            lines.append(f"| {result['run']} | {row['kind']} | {row['verdict']} | {decision} | "
                         f"{_s(row['delay_s'])} | {_s(row['alone_s'])} | {_x(row['x_bound'])} |")
    misses = [(result["run"], row) for result in summary["results"] for row in result["incidents"]
              if row["verdict"] != "right" and row.get("covered")]
    if misses:
        lines += ["", "Incidents not decided for their own cause, and what their gate held when another cause's "
                  "fallback covered their key:", "",
                  "| run | incident | covered by | after | evidence | threshold / last look | counted |",
                  "|---|---|---|---|---|---|---|"]
        for run, row in misses:
            c = row["covered"]
            if "evidence_nats" in c:
                held, bar = f"{c['evidence_nats']:.2f} nats", (f"{c['evidence_threshold_nats']:.1f} / "
                                                              f"{c['look_threshold_nats']:.1f} nats")
                counted = f"{c['hits']:g} of {c['trials']} requests"
            elif "shadow_checks" in c:
                held, bar = f"{c['strict_mismatches']} strict mismatches", "1"
                counted = f"{c['shadow_checks']} shadow checks"
            else:
                held, bar, counted = f"{c.get('breaching_windows', '-')} breaching windows", "-", "-"
            lines.append(f"| {run} | {row['kind']} | {c['by']} {c['scope']} | {_s(c['after_s'])} | {held} | "
                         f"{bar} | {counted} |")
    return "\n".join(lines)


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _x(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}x"
