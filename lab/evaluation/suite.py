"""The evaluation suite: seeded simulator runs open loop through the embedded pipeline and both
operator baselines at once, so every detector sees the same telemetry."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from specwatch.lab.simulation.simulator import BUCKETS, Simulator
from specwatch.schemas import Policy, RequestRecord, ShadowRecord, StepRecord
from specwatch.streams.embedded import EmbeddedPipeline

from .baselines import AcceptanceKillSwitch, PrometheusRatioAlert
from .bounds import information_bound
from .draft_length import MINUTES as DRAFT_LENGTH_MINUTES, WORKERS as DRAFT_LENGTH_WORKERS
from .draft_length import DraftLengthCase, run_draft_length
from .scoring import BASELINE_REASON, Alarm, decision_alarm, judge, stray_alarms

__all__ = ["DETECTORS", "LEVELS", "TARGETS", "Case", "BaselineSettings", "calibrate", "full_suite",
           "incident_kind", "pooled", "quick_suite", "rollout_cases", "run_case", "run_rollout", "run_suite"]

DETECTORS = ("specwatch", "kill_switch", "prometheus")

# Incidents start after the baselines are learned (60 s of event time) with room to spare.
_INCIDENT_AT = 90.0
_QUIET_INCIDENT_AT = 300.0
_DEFAULT_SEED = 11
_CALIBRATION_SEED = 5
_CALIBRATION_MINUTES = 3.0
# How operators set both acceptance-rate thresholds: the healthy fleet's rate, less a margin
# wide enough that the dashboard's normal wiggle never crosses it.
_BASELINE_MARGIN = 0.10
_KILL_SWITCH_WINDOW = 1000  # iterations: ~15 s of one worker's engine steps
_ALERT_RANGE_SECONDS = 300.0
_ALERT_FOR_SECONDS = 120.0
_ALERT_INTERVAL_SECONDS = 15.0

# Event time each kind of incident is watched for after it starts (docs/EVALUATION.md,
# "Observation window"): acceptance incidents for five minutes, as the alert rule needs its 2 m
# 'for'; shadow checks are rare, so at 5% mismatches the first can take minutes.
_OBSERVE_SECONDS = {"acceptance_drop": 300.0, "target_update": 300.0, "bundle_change": 30.0,
                    "draft_regression": 60.0, "kv_pressure": 40.0, "quality_mismatch": 180.0,
                    "error_burst": 180.0, "latency_tail": 240.0}
# Detection targets at the default fleet, seconds after the incident start (after the first
# mismatch record for quality): what `specwatch evaluate` checks each right detection against.
TARGETS = {"bundle_change": 2.0, "target_update": 2.0, "acceptance_drop": 30.0, "draft_regression": 30.0,
           "kv_pressure": 10.0, "quality_mismatch": 5.0, "error_burst": 120.0, "latency_tail": 180.0}


# Fleet sizes of the traffic sweep (workers x running requests per worker): from one small
# engine to four times the default fleet. Each key's traffic grows with their product.
LEVELS = ((1, 4), (2, 8), (8, 16), (32, 16))
_DEFAULT_LEVEL = (8, 16)
_DEFAULT_SLOTS = _DEFAULT_LEVEL[0] * _DEFAULT_LEVEL[1]
# Finished requests per minute of the incident key per running-request slot of the fleet, to
# size how long a slow incident is watched (measured on healthy traffic, seed 11: main cohorts
# at 2 x 16, quiet keys at 8 x 16).
_REQUESTS_PER_MINUTE_PER_SLOT = {"error_burst": 4.2, "latency_tail": 5.4,
                                 "error_burst_quiet_bucket": 0.71, "latency_tail_quiet_bucket": 1.19,
                                 "error_burst_quiet_cohort": 0.26, "latency_tail_quiet_cohort": 0.21}
# Median decode time of a reasoning request (measured, seed 11): how long a stall holds a
# tail's records back, for the watch's estimate of the bound.
_REASONING_DECODE_SECONDS = 3.7
# A weak incident is watched for this multiple of its information bound (the target is 2x),
# up to the cap: beyond it the suite reports the bound and 'missed' within the watch.
_WATCH_BOUNDS = 2.5
_WATCH_CAP_SECONDS = 1800.0
_SCALED_WATCHES = ("quality_mismatch", "kv_pressure")


@dataclass(frozen=True)
class Case:
    """One seeded simulator run of the suite; ``label`` says its intensity in its own unit."""

    scenario: str
    intensity: float | None
    label: str
    minutes: float
    workers: int = 8
    concurrency: int = 16
    seed: int = _DEFAULT_SEED
    target_intensity: bool = False  # the intensity a detection target is stated for
    compare_baselines: bool = True  # False: stop once specwatch decided; the baselines are not judged
    incident_at: float = _INCIDENT_AT

    @property
    def rollout(self) -> bool:
        """A closed-loop rollout under admission (`run_rollout`), not an open-loop incident run."""
        return self.scenario in _ROLLOUTS

    @property
    def healthy(self) -> bool:
        return self.scenario in ("healthy", "diurnal", "mix_shift")

    @property
    def name(self) -> str:
        suffix = "" if self.intensity is None else f"@{self.intensity:g}"
        return f"{self.scenario}{suffix}/w{self.workers}c{self.concurrency}/s{self.seed}"


def _watch_seconds(scenario: str, intensity: float | None, workers: int, concurrency: int,
                   policy: Policy | None = None) -> float:
    """How long an incident is watched: its fixed span, longer where the bound says it must be."""
    kind = incident_kind(scenario)
    seconds = _OBSERVE_SECONDS[kind]
    if kind in _SCALED_WATCHES:
        # shadow checks and KV peaks come with the fleet's running requests: a smaller fleet
        # is watched for longer (its case stops once specwatch has decided)
        return min(_WATCH_CAP_SECONDS, seconds * max(1.0, _DEFAULT_SLOTS / (workers * concurrency)))
    per_slot = _REQUESTS_PER_MINUTE_PER_SLOT.get(scenario)
    if per_slot is None:
        return seconds
    bound = information_bound(kind, intensity, per_slot * workers * concurrency / 60.0,
                              _budget(policy or Policy(), kind), decode_seconds=(_REASONING_DECODE_SECONDS,))
    if bound is None:
        return seconds
    return max(seconds, min(_WATCH_CAP_SECONDS, _WATCH_BOUNDS * bound["seconds"] + 30.0))


def incident_kind(scenario: str) -> str:
    """The incident kind a scenario scripts: its quiet-key variants share their kind's watch and bound.

    >>> incident_kind("error_burst_quiet_cohort"), incident_kind("kv_pressure")
    ('error_burst', 'kv_pressure')
    """
    return scenario.split("_quiet_")[0]


def _budget(policy: Policy, kind: str) -> float:
    """False alarms per key-hour of the gate that decides ``kind``: its bound is held to the same."""
    gate = policy.latency if kind == "latency_tail" else policy.errors
    return gate.false_alarms_per_key_hour


# How a case's label says its incident, in the incident's own unit.
_LABELS = {
    "acceptance_drop": "coding AL -{:.0%}", "target_update": "new target, AL -{:.0%}",
    "bundle_change": "tokenizer digest", "draft_regression": "draft time x{:g}",
    "latency_tail": "10% reasoning/main x{:g}", "kv_pressure": "long-context surge {:.0%}",
    "quality_mismatch": "{:.0%} shadow mismatches", "error_burst": "extraction errors x{:g}",
    "error_burst_quiet_bucket": "quiet extraction (3%) errors x{:g}",
    "error_burst_quiet_cohort": "extraction/canary (5%) errors x{:g}",
    "latency_tail_quiet_bucket": "10% of quiet reasoning (3%)/main x{:g}",
    "latency_tail_quiet_cohort": "10% of reasoning/canary (5%) x{:g}",
    "acceptance_drop_quiet_bucket": "quiet coding (3%) AL -{:.0%}",
}


def _incident_case(scenario: str, intensity: float | None, target: bool = False,
                   level: tuple[int, int] = _DEFAULT_LEVEL, compare_baselines: bool = True,
                   label: str | None = None) -> Case:
    workers, concurrency = level
    # A small fleet's keys learn for longer (until their baselines hold enough requests): its
    # incidents start once the longest learning is over, so they never teach a baseline.
    start = _INCIDENT_AT if workers * concurrency >= 64 else _QUIET_INCIDENT_AT
    minutes = (start + _watch_seconds(scenario, intensity, workers, concurrency)) / 60.0
    return Case(scenario, intensity, label or _LABELS[scenario].format(intensity), minutes,
                workers=workers, concurrency=concurrency, incident_at=start,
                target_intensity=target and level == _DEFAULT_LEVEL,
                compare_baselines=compare_baselines)


# Every kind at three intensities (the simulator allows errors up to x48), the one its target
# is stated for second.
_INCIDENT_CASES = tuple(
    _incident_case(kind, intensity, target=intensity == target)
    for kind, intensities, target in (
        ("acceptance_drop", (0.15, 0.25, 0.40), 0.25), ("target_update", (0.25, 0.50), 0.50),
        ("bundle_change", (None,), None), ("draft_regression", (2.0, 3.0, 5.0), 3.0),
        ("latency_tail", (3.0, 5.0, 10.0), 5.0), ("kv_pressure", (0.4, 0.6, 0.8), 0.6),
        ("quality_mismatch", (0.05, 0.2, 0.5), 0.5), ("error_burst", (5.0, 20.0, 40.0), 20.0))
    for intensity in intensities)

# The sweep below the default fleet and above it: every kind at two intensities, the weak
# one included (errors x5). Only specwatch is judged there; the baselines are compared at
# the default fleet, above.
_SWEEP_INTENSITIES = {
    "acceptance_drop": (0.25, 0.40), "target_update": (0.50,), "bundle_change": (None,),
    "draft_regression": (2.0, 3.0), "latency_tail": (3.0, 10.0), "kv_pressure": (0.6, 0.8),
    "quality_mismatch": (0.2, 0.5), "error_burst": (5.0, 20.0)}
_SWEEP_CASES = tuple(_incident_case(kind, intensity, level=level, compare_baselines=False)
                     for level in LEVELS if level != _DEFAULT_LEVEL
                     for kind, strengths in _SWEEP_INTENSITIES.items() for intensity in strengths)
# Quiet keys inside the default and the big fleet: a bucket with about 3 % of the traffic and
# the canary cohort (5 %), for the kinds whose evidence grows with a key's traffic.
_QUIET_LEVELS = (_DEFAULT_LEVEL, (32, 16))
_QUIET_KEYS = {
    "error_burst_quiet_bucket": (5.0, 20.0), "error_burst_quiet_cohort": (5.0, 20.0),
    "latency_tail_quiet_bucket": (3.0, 10.0), "latency_tail_quiet_cohort": (3.0, 10.0),
    "acceptance_drop_quiet_bucket": (0.25,)}
_QUIET_CASES = tuple(_incident_case(scenario, intensity, level=level, compare_baselines=False)
                     for level in _QUIET_LEVELS
                     for scenario, strengths in _QUIET_KEYS.items() for intensity in strengths)

# Stalls: 10 % of reasoning/main requests hang for minutes (x50), their records due only when
# the stall ends. The e2e tail test counts them while they run (docs/EVALUATION.md).
_STALL_CASES = tuple(_incident_case("latency_tail", 50.0, level=level, compare_baselines=False,
                                    label="10% reasoning/main stalled for minutes (x50)")
                     for level in ((2, 8), _DEFAULT_LEVEL))


def _healthy_cases(level: tuple[int, int], minutes: tuple[float, float, float]) -> tuple[Case, ...]:
    """Incident-free runs on one fleet size: steady, a day-shaped load cycle, a drifting mix."""
    labels = {"healthy": "steady load and mix", "diurnal": "one day-shaped load cycle",
              "mix_shift": "mix drifts to reasoning/long context"}
    return tuple(Case(scenario, None, label, length, workers=level[0], concurrency=level[1])
                 for (scenario, label), length in zip(labels.items(), minutes))


# Incident-free runs at every fleet size: 80 simulated minutes each, which is 24 key-hours
# over the 18 bucket/cohort keys that carry traffic (the benign changes included).
_HEALTHY_CASES = tuple(c for level in LEVELS for c in _healthy_cases(level, (20.0, 40.0, 20.0)))
# --quick runs no steady healthy run at 2 x 8: its incident runs there are one, up to their
# incident at 300 s (a seeded simulator writes the same records before its incident), and that
# time counts as incident-free.
_QUICK_HEALTHY_CASES = _healthy_cases((2, 8), (0.0, 5.0, 5.0))[1:] + _healthy_cases((1, 4), (10.0, 0.0, 0.0))[:1]
# --quick: the target cases at the default fleet and the weakest kinds at 2 x 8,
# each stopped once specwatch has decided.
_QUICK_SWEEP = (("error_burst", 20.0), ("latency_tail", 5.0))


def full_suite(seed: int = _DEFAULT_SEED) -> list[Case]:
    """Every fallback-table row at three intensities against the baselines, the traffic sweep,
    quiet keys in the default and the big fleet, stalls at 2 x 8 and 8 x 16, 4 x 80 min healthy, and 20 healthy rollouts,
    20 card changes and 3 of each canary incident."""
    return ([replace(c, seed=seed) for c in
             _INCIDENT_CASES + _SWEEP_CASES + _QUIET_CASES + _STALL_CASES + _HEALTHY_CASES]
            + rollout_cases(20, 3, seed))


def quick_suite(seed: int = _DEFAULT_SEED) -> list[Case]:
    """Each row at its target intensity (specwatch only), two small-fleet cases, 20 healthy minutes."""
    cases = [replace(c, compare_baselines=False) for c in _INCIDENT_CASES if c.target_intensity]
    cases += [_incident_case(kind, intensity, level=(2, 8), compare_baselines=False)
              for kind, intensity in _QUICK_SWEEP]
    return ([replace(c, seed=seed) for c in cases + list(_QUICK_HEALTHY_CASES)]
            + [c for c in rollout_cases(0, 1, seed) if c.scenario == "canary_mismatch"])


# -- the baselines' settings ---------------------------------------------------------------------


@dataclass(frozen=True)
class BaselineSettings:
    """Thresholds of both baselines, derived from a healthy calibration run like an operator would."""

    healthy_rate: float
    kill_switch_threshold: float
    kill_switch_window: int = _KILL_SWITCH_WINDOW
    alert_threshold: float = math.nan
    alert_range_seconds: float = _ALERT_RANGE_SECONDS
    alert_for_seconds: float = _ALERT_FOR_SECONDS
    alert_interval_seconds: float = _ALERT_INTERVAL_SECONDS
    margin: float = _BASELINE_MARGIN

    @classmethod
    def from_healthy_rate(cls, rate: float, margin: float = _BASELINE_MARGIN) -> "BaselineSettings":
        """Both thresholds at the healthy fleet acceptance rate less ``margin``, to two decimals.

        >>> s = BaselineSettings.from_healthy_rate(0.3498)
        >>> s.kill_switch_threshold, s.alert_threshold
        (0.25, 0.25)
        """
        threshold = round(rate - margin, 2)
        return cls(round(rate, 4), threshold, alert_threshold=threshold, margin=margin)

    def to_dict(self) -> dict:
        return {
            "healthy_acceptance_rate": self.healthy_rate,
            "margin": self.margin,
            "kill_switch": {"threshold": self.kill_switch_threshold, "window_iterations": self.kill_switch_window,
                            "scope": "per worker, all traffic; permanent"},
            "prometheus": {"threshold": self.alert_threshold, "rate_range_seconds": self.alert_range_seconds,
                           "for_seconds": self.alert_for_seconds,
                           "scrape_and_eval_interval_seconds": self.alert_interval_seconds,
                           "expr": "sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m])) / "
                                   "sum(rate(vllm:spec_decode_num_draft_tokens_total[5m])) < threshold",
                           "scope": "fleet, all traffic"},
        }


def calibrate(seed: int = _CALIBRATION_SEED, minutes: float = _CALIBRATION_MINUTES, workers: int = 8,
              margin: float = _BASELINE_MARGIN) -> BaselineSettings:
    """Measure the healthy fleet's acceptance rate (accepted / drafted tokens) on its own seed."""
    accepted = drafted = 0
    for record in Simulator("healthy", seed=seed, minutes=minutes, workers=workers).records():
        if isinstance(record, StepRecord):
            for entry in record.requests:
                accepted += entry.accepted
                drafted += entry.drafted
    return BaselineSettings.from_healthy_rate(accepted / drafted, margin)


# -- one case --------------------------------------------------------------------------------


@dataclass
class _Watch:
    """The baselines fed from the same records as the pipeline, and everyone's alarms."""

    settings: BaselineSettings
    alarms: dict[str, list[Alarm]] = field(default_factory=lambda: {d: [] for d in DETECTORS})
    switches: dict[str, AcceptanceKillSwitch] = field(default_factory=dict)
    alert: PrometheusRatioAlert | None = None
    watch_from: float = math.inf
    lateness: float = 0.0
    # How close each baseline came to its threshold before any incident: the lowest rolling
    # rate a warm kill switch saw, and the lowest ratio the alert rule evaluated.
    lowest_switch_rate: float = math.inf
    lowest_alert_ratio: float = math.inf
    silent: set[str] = field(default_factory=lambda: set(DETECTORS))  # no alarm since watch_from yet
    baselines: bool = True  # False: the case does not judge the baselines, so they are not fed
    # The incident key's traffic before the incident: finished requests and speculative rounds.
    key: tuple[str, str] | None = None
    key_requests: int = 0
    key_rounds: int = 0
    key_decode_seconds: list[float] = field(default_factory=list)  # how long a stall would hold each back

    def __post_init__(self) -> None:
        s = self.settings
        self.alert = PrometheusRatioAlert(s.alert_threshold, s.alert_range_seconds, s.alert_for_seconds,
                                          s.alert_interval_seconds)

    def step(self, record: StepRecord) -> None:
        key = self.key
        if record.ts < self.watch_from and key is not None:  # the incident key's rounds: its bound
            self.key_rounds += sum(1 for e in record.requests
                                   if e.drafted and (e.bucket, e.cohort) == key)
        if not self.baselines:
            return
        accepted = sum(entry.accepted for entry in record.requests)
        drafted = sum(entry.drafted for entry in record.requests)
        switch = self.switches.get(record.worker)
        if switch is None:
            switch = self.switches[record.worker] = AcceptanceKillSwitch(self.settings.kill_switch_window,
                                                                         self.settings.kill_switch_threshold)
        switch.update(accepted, drafted)
        if record.ts < self.watch_from and switch.warm and not switch.disabled:
            self.lowest_switch_rate = min(self.lowest_switch_rate, switch.rolling_rate)
        if switch.drift_detected:
            self._add(Alarm("kill_switch", record.ts, BASELINE_REASON, None, worker=record.worker,
                            action="disable_speculation"))
        evaluated = self.alert.evaluations
        self.alert.update(record.ts, accepted, drafted)
        if self.alert.evaluations != evaluated and record.ts < self.watch_from and not math.isnan(self.alert.ratio):
            self.lowest_alert_ratio = min(self.lowest_alert_ratio, self.alert.ratio)
        if self.alert.drift_detected:
            self._add(Alarm("prometheus", self.alert.fired_at, BASELINE_REASON, None, action="alert"))

    def released(self, output) -> None:
        """Stage-2 output sink: a decision can be acted on once its slice closed, at the watermark."""
        for action in output.actions:
            d = action.decision
            self._add(decision_alarm(d, max(d.ts, output.slice_end + self.lateness)))

    def _add(self, alarm: Alarm) -> None:
        self.alarms[alarm.detector].append(alarm)
        if alarm.ts >= self.watch_from:
            self.silent.discard(alarm.detector)


def _simulator(case: Case) -> Simulator:
    return Simulator(case.scenario, seed=case.seed, minutes=case.minutes, workers=case.workers,
                     intensity=case.intensity, incident_at=None if case.healthy else case.incident_at,
                     concurrency=case.concurrency)


def run_case(case: Case, settings: BaselineSettings, policy: Policy | None = None) -> dict:
    """One case's JSON-able verdicts per incident and false alarms; it stops early once every
    detector it judges has alarmed after the incident."""
    started = time.monotonic()
    sim = _simulator(case)
    incidents = sim.incidents
    first_start = min((i.start_ts for i in incidents), default=math.inf)
    policy = policy or Policy()
    watch = _Watch(settings, watch_from=first_start, lateness=policy.windows.lateness_seconds)
    if not case.compare_baselines:
        watch.silent = {"specwatch"}
        watch.baselines = False
    if incidents and incidents[0].bucket is not None:
        watch.key = (incidents[0].bucket, incidents[0].cohort or "main")
    pipeline = EmbeddedPipeline(policy, sinks=[watch.released])
    first_mismatch: float | None = None
    last_ts = sim.start_ts
    records = 0
    over_watermark: set[int] = set()  # slices after the incident start with a step's KV over the watermark
    # only a KV surge's row reads them
    watermark = policy.kv.watermark if any(i.kind == "kv_pressure" for i in incidents) else math.inf
    slice_seconds = policy.windows.slice_seconds
    for record in sim.records():
        records += 1
        last_ts = record.ts
        if isinstance(record, StepRecord):
            watch.step(record)
            if record.kv_usage > watermark and record.ts >= first_start:
                over_watermark.add(int(record.ts // slice_seconds))
        elif isinstance(record, RequestRecord):
            if record.ts < first_start and watch.key == (record.bucket, record.cohort):
                watch.key_requests += 1
                if record.e2e_ms is not None and record.ttft_ms is not None:
                    watch.key_decode_seconds.append((record.e2e_ms - record.ttft_ms) / 1000.0)
        elif (isinstance(record, ShadowRecord) and not record.match and first_mismatch is None
              and record.ts >= first_start):
            first_mismatch = record.ts
        pipeline.feed(record)
        if not watch.silent:
            break  # every detector has had its say on the incident
    pipeline.finish()
    result = _result(case, sim, incidents, watch.alarms, first_mismatch, last_ts, records,
                     time.monotonic() - started)
    before = first_start - sim.start_ts
    for row in result["incidents"]:
        per_second = (watch.key_rounds if row["kind"] == "acceptance_drop" else watch.key_requests) / before
        row["key_requests_per_minute"] = round(watch.key_requests / before * 60.0, 1)
        row["bound"] = information_bound(row["kind"], case.intensity, per_second, _budget(policy, row["kind"]),
                                         row["bucket"], watch.key_decode_seconds,
                                         watch.key_rounds / watch.key_requests if watch.key_requests else None)
        row["watched_s"] = round(last_ts - incidents[0].start_ts, 1)
        if row["kind"] == "kv_pressure":
            _kv_evidence(row, over_watermark, policy.kv.consecutive, slice_seconds)
    result["baseline_headroom"] = {
        "kill_switch_lowest_rolling_rate": _finite_or_none(watch.lowest_switch_rate),
        "kill_switch_threshold": settings.kill_switch_threshold,
        "prometheus_lowest_ratio": _finite_or_none(watch.lowest_alert_ratio),
        "prometheus_threshold": settings.alert_threshold,
    }
    return result


def _kv_evidence(row: dict, over_watermark: set[int], consecutive: int, slice_seconds: float) -> None:
    """What a KV surge put in front of the gate: slices with a step over the watermark, the
    longest run of them, and when the first run of ``consecutive`` slices began (seconds after the
    incident start). A surge that never holds KV over it that long is a spike the gate is meant
    to ride out: its verdict is ``not_reached`` instead of missed."""
    longest = run = 0
    previous = sustained = None
    for index in sorted(over_watermark):
        run = run + 1 if previous == index - 1 else 1
        longest, previous = max(longest, run), index
        if sustained is None and run == consecutive:
            sustained = round((index - consecutive + 1) * slice_seconds - row["start_ts"], 1)
    row["kv_over_watermark"] = {"slices": len(over_watermark), "longest_run_slices": longest,
                                "slices_needed": consecutive, "sustained_from_s": sustained}
    if row["specwatch"]["verdict"] == "missed" and longest < consecutive:
        row["specwatch"]["verdict"] = "not_reached"


def _finite_or_none(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


_CASE_FIELDS = ("compare_baselines", "scenario", "intensity", "label", "healthy",
                "target_intensity", "workers", "concurrency", "seed")


def _result(case: Case, sim: Simulator, incidents, alarms: dict[str, list[Alarm]], first_mismatch: float | None,
            last_ts: float, records: int, wall: float) -> dict:
    first_start = min((i.start_ts for i in incidents), default=last_ts)
    covered = last_ts - sim.start_ts
    out = {
        "case": case.name,
        **{name: getattr(case, name) for name in _CASE_FIELDS},
        "simulated_seconds": round(covered, 3),
        "incident_free_seconds": round(first_start - sim.start_ts, 3),
        "buckets": len(BUCKETS),
        "records": records,
        "wall_seconds": round(wall, 2),
        "incidents": [],
        "false_alarms": {},
        "alarms": {d: [a.to_dict() for a in alarms[d]] for d in DETECTORS},
    }
    for incident in incidents:
        reference = first_mismatch if incident.kind == "quality_mismatch" and first_mismatch is not None else None
        row = {"kind": incident.kind, "start_ts": incident.start_ts, "bucket": incident.bucket,
               "cohort": incident.cohort, "expected_reason": incident.expected_reason,
               "measured_from": "first_mismatch_record" if reference is not None else "incident_start",
               "reference_ts": reference if reference is not None else incident.start_ts,
               "target_s": TARGETS.get(incident.kind) if case.target_intensity else None}
        for detector in DETECTORS:
            row[detector] = judge(incident, alarms[detector], reference).to_dict()
        out["incidents"].append(row)
    for detector in DETECTORS:
        stray = stray_alarms(incidents, alarms[detector])
        out["false_alarms"][detector] = {
            "before_incident": sum(1 for a in stray if a.ts < first_start),
            "after_incident": sum(1 for a in stray if a.ts >= first_start),
            "alarms": [a.to_dict() for a in stray],
        }
    return out


def _run_one(job: tuple[int, Case | DraftLengthCase, BaselineSettings, Policy | None, int]) -> tuple[int, dict]:
    index, case, settings, policy, seed = job
    if isinstance(case, DraftLengthCase):
        started = time.monotonic()
        result = run_draft_length(case, seed)
        return index, {**result, "case": f"draft_length/{case.scenario}/s{seed}",
                       "simulated_seconds": DRAFT_LENGTH_MINUTES * 60.0,
                       "wall_seconds": round(time.monotonic() - started, 2)}
    if case.rollout:
        return index, run_rollout(case)
    return index, run_case(case, settings, policy)


def _work(case: Case | DraftLengthCase) -> float:
    """Simulated worker-minutes of one job: the pool starts the longest first."""
    if isinstance(case, DraftLengthCase):
        return DRAFT_LENGTH_MINUTES * DRAFT_LENGTH_WORKERS
    return case.minutes * case.workers


def run_suite(cases: Iterable[Case], settings: BaselineSettings, policy: Policy | None = None,
              processes: int = 1, progress: Callable[[dict], None] | None = None,
              draft_length: Sequence[DraftLengthCase] = (), draft_length_seed: int = _DEFAULT_SEED) -> list[dict]:
    """Run every case, then the ``draft_length`` cases, on ``processes`` worker processes;
    results come back in that order."""
    cases = list(cases) + list(draft_length)
    for case in cases:  # settings the simulator refuses fail here, before minutes of running
        if isinstance(case, Case) and not case.rollout:
            _simulator(case)
    # Longest first, so the pool does not end waiting on one long run.
    order = sorted(range(len(cases)), key=lambda i: -_work(cases[i]))
    jobs = [(i, cases[i], settings, policy, draft_length_seed) for i in order]
    results: dict[int, dict] = {}
    for i, result in pooled(_run_one, jobs, processes):
        results[i] = result
        if progress is not None:
            progress(result)
    return [results[i] for i in range(len(cases))]


def pooled(function: Callable, jobs: Sequence, processes: int) -> Iterable:
    """``function`` over ``jobs``, here or on ``processes`` forked workers, results as they come."""
    with contextlib.ExitStack() as stack:
        done = map(function, jobs)
        if processes > 1:  # fork keeps start-up cheap; each case builds its own simulator, pipeline
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(processes))
            done = pool.imap_unordered(function, jobs)
        yield from done


# -- rollouts under admission -----------------------------------------------------------------

# The documented admission policy (docs/admission-policy.toml; tests/test_admission.py checks
# they agree): shares and stage times sized so a whole rollout fits in minutes of the default fleet.
ROLLOUT_POLICY = {"admission": {"enforce": True, "shadow_share": 0.2, "cohort_schedule": [0.1, 0.25, 1.0],
                                "stage_seconds": 90, "window_requests": 10, "min_windows": 8,
                                "min_shadow_checks": 20}}
# Rollout scenarios and whether the new bundle must end frozen by its judge.
_ROLLOUTS = {"admission": False, "admission_change": False, "canary_tail": True, "canary_mismatch": True}
_ROLLOUT_MINUTES = 8.0


def rollout_cases(healthy_seeds: int, frozen_seeds: int, first_seed: int = _DEFAULT_SEED) -> list[Case]:
    """Healthy rollouts and card changes on ``healthy_seeds`` seeds, the canary incidents on ``frozen_seeds``."""
    out = []
    for scenario, frozen in _ROLLOUTS.items():
        for seed in range(first_seed, first_seed + (frozen_seeds if frozen else healthy_seeds)):
            out.append(Case(scenario, None, "rollout under admission", _ROLLOUT_MINUTES, seed=seed,
                            compare_baselines=False))
    return out


def run_rollout(case: Case) -> dict:
    """One closed-loop rollout under `ROLLOUT_POLICY`: ``ok`` when a healthy one is never frozen
    nor pages anyone, and a canary incident ends frozen in the structured bucket (the run stops)."""
    from specwatch.actions.flags import FlagStore

    started = time.monotonic()
    flags = FlagStore()
    pipeline = EmbeddedPipeline(Policy.model_validate(ROLLOUT_POLICY), flags=flags)
    sim = Simulator(case.scenario, seed=case.seed, workers=case.workers, minutes=case.minutes, flags=flags,
                    concurrency=case.concurrency)
    expect_freeze = _ROLLOUTS[case.scenario]
    frozen = False
    for record in sim.records():
        pipeline.feed(record)
        if expect_freeze and pipeline.decisions and any(d.reason == "canary_judgement" and
                                                        d.evidence.get("stage") == "frozen"
                                                        for d in pipeline.decisions):
            frozen = True
            break
    pipeline.finish()
    decisions = [{"ts": round(d.ts - sim.start_ts, 2), "action": d.action, "reason": d.reason,
                  "bucket": d.bucket, "stage": d.evidence.get("stage"), "bundle_id": d.bundle_id}
                 for d in pipeline.decisions]
    freezes = [d for d in decisions if d["reason"] == "canary_judgement" and d["stage"] == "frozen"]
    alerts = [d for d in decisions if d["action"] == "alert"]
    # Anything that switches speculation off for a cause other than the scripted card change.
    fallbacks = [d for d in decisions if d["action"] in ("disable_speculation", "reduce_draft_length")
                 and d["reason"] not in ("canary_judgement", "unadmitted_bundle")]
    if expect_freeze:
        ok = bool(freezes) and all(d["bucket"] in (None, "structured") for d in freezes)
    else:
        ok = not freezes and not alerts and not fallbacks
    return {"case": case.name, "scenario": case.scenario, "seed": case.seed, "expect_freeze": expect_freeze,
            "ok": ok, "frozen": bool(freezes) or frozen, "freezes": freezes, "alerts": alerts,
            "fallbacks": fallbacks, "decisions": decisions,
            "simulated_seconds": round(sim.duration, 1), "wall_seconds": round(time.monotonic() - started, 2)}
