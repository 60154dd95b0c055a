"""Judging detections against ground truth: delay, right/wrong reason and scope, false alarms;
pure functions over what a run produced and what the simulator scripted."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Alarm", "Verdict", "decision_alarm", "judge", "match_incidents", "stray_alarms", "BASELINE_REASON"]

# What the two acceptance-rate baselines would say if they could say why: acceptance fell.
BASELINE_REASON = "acceptance_drop"

# Reasons that also count as naming an incident correctly, because the table's remedy for
# them is the remedy for the incident: a new target revision breaks the drafter ("acceptance
# fell"), and a slower drafter leaves the hard buckets with no speedup at all.
_ALSO_RIGHT = {
    "target_update": frozenset({"acceptance_drop", "no_speedup"}),
    "draft_regression": frozenset({"no_speedup"}),
}

# Decisions that give speculation back (or widen it) never answer an incident.
_GIVING_BACK = frozenset({"restore", "promote"})

RIGHT = "right"
WRONG_SCOPE = "wrong scope"
WRONG_REASON = "wrong reason"
MISSED = "missed"


@dataclass(frozen=True)
class Alarm:
    """One decision of any detector, reduced to what judging needs: ``ts`` is when it could be
    acted on (docs/EVALUATION.md, "Delay"); None for ``bucket``/``cohort`` means every one."""

    detector: str
    ts: float
    reason: str
    bundle_id: str | None
    bucket: str | None = None
    cohort: str | None = None
    worker: str | None = None
    action: str = ""
    decision_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def decision_alarm(decision, ts: float | None = None) -> Alarm:
    """A specwatch `Decision` as an alarm, available to act on at ``ts`` (default: its own time)."""
    return Alarm("specwatch", decision.ts if ts is None else ts, decision.reason, decision.bundle_id,
                 decision.bucket, decision.cohort, action=decision.action, decision_id=decision.id)


@dataclass(frozen=True)
class Verdict:
    """How one detector did on one incident."""

    verdict: str
    delay_s: float | None = None
    alarm: Alarm | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _scope(incident, alarm: Alarm) -> str:
    """'inside' when the alarm acts within the incident's scope, else 'broader' or 'elsewhere'.

    A bundle-wide alarm (or a whole worker's kill switch) on an incident confined to one
    bucket or cohort is broader: it switches off traffic that was fine.
    """
    if alarm.bundle_id is not None and alarm.bundle_id != incident.bundle_id:
        return "elsewhere"
    if alarm.worker is not None and incident.workers and alarm.worker not in incident.workers:
        return "elsewhere"
    for wanted, got in ((incident.bucket, alarm.bucket), (incident.cohort, alarm.cohort)):
        if wanted is None:
            continue
        if got is None:
            return "broader"
        if got != wanted:
            return "elsewhere"
    if alarm.worker is not None and (incident.bucket is not None or incident.cohort is not None):
        return "broader"  # a per-worker switch turns off every bucket and cohort on the worker
    return "inside"


def _right_reasons(incident) -> frozenset[str]:
    return frozenset({incident.expected_reason}) | _ALSO_RIGHT.get(incident.kind, frozenset())


def judge(incident, alarms: list[Alarm], reference_ts: float | None = None) -> Verdict:
    """The verdict of one detector's alarms on one incident (docs/EVALUATION.md, "Verdict"), its
    delay measured from ``reference_ts`` (default: the incident start). Giving speculation back
    (``restore``, ``promote``) is never an answer.

    >>> from types import SimpleNamespace as I
    >>> drop = I(kind="acceptance_drop", start_ts=100.0, bundle_id="b-1", bucket="coding", cohort=None,
    ...          expected_reason="acceptance_drop", workers=())
    >>> judge(drop, [Alarm("specwatch", 112.5, "acceptance_drop", "b-1", "coding", "main")])
    Verdict(verdict='right', delay_s=12.5, alarm=Alarm(detector='specwatch', ts=112.5, ...))
    >>> judge(drop, [Alarm("kill_switch", 104.0, "acceptance_drop", None, worker="w3")]).verdict
    'wrong scope'
    >>> judge(drop, [Alarm("specwatch", 90.0, "acceptance_drop", "b-1", "coding", "main")]).verdict
    'missed'
    """
    start = incident.start_ts
    reference = start if reference_ts is None else reference_ts
    after = sorted((a for a in alarms if a.ts >= start and a.action not in _GIVING_BACK), key=lambda a: a.ts)
    right = _right_reasons(incident)
    picks = (
        (RIGHT, [a for a in after if a.reason in right and _scope(incident, a) == "inside"]),
        (WRONG_SCOPE, [a for a in after if a.reason in right]),
        (WRONG_REASON, [a for a in after if _scope(incident, a) != "elsewhere"]),
    )
    for verdict, found in picks:
        if found:
            return Verdict(verdict, round(found[0].ts - reference, 3), found[0])
    return Verdict(MISSED)


def stray_alarms(incidents, alarms: list[Alarm]) -> list[Alarm]:
    """Alarms that are false: before every incident, or not right for any incident running.

    An alarm after an incident started is fine only if it names that incident's reason
    inside its scope (later escalations of a right decision included). Giving speculation
    back is no alarm.

    >>> from types import SimpleNamespace as I
    >>> burst = I(kind="error_burst", start_ts=100.0, bundle_id="b-1", bucket="extraction", cohort=None,
    ...           expected_reason="error_rate", workers=())
    >>> alarms = [Alarm("specwatch", 50.0, "latency_slo", "b-1", "coding", "main"),
    ...           Alarm("specwatch", 130.0, "error_rate", "b-1", "extraction", "main"),
    ...           Alarm("specwatch", 140.0, "error_rate", "b-1", "coding", "main")]
    >>> [(a.ts, a.bucket) for a in stray_alarms([burst], alarms)]
    [(50.0, 'coding'), (140.0, 'coding')]
    """
    return [alarm for alarm in alarms if alarm.action not in _GIVING_BACK
            and not any(alarm.ts >= incident.start_ts and alarm.reason in _right_reasons(incident)
                        and _scope(incident, alarm) == "inside" for incident in incidents)]


def match_incidents(incidents, alarms: list[Alarm]) -> list[dict]:
    """One row per incident: the verdict of ``alarms`` on it (`judge`), with the alarm that decided it.

    >>> from types import SimpleNamespace as I
    >>> tail = I(kind="latency_tail", start_ts=100.0, bundle_id="b-1", bucket="reasoning", cohort="main",
    ...          expected_reason="latency_slo", workers=())
    >>> row, = match_incidents([tail], [Alarm("specwatch", 130.0, "latency_slo", "b-1", "reasoning", "main",
    ...                                       action="disable_speculation", decision_id="d-1")])
    >>> row["verdict"], row["decision_id"], row["detection_delay_s"]
    ('right', 'd-1', 30.0)
    """
    rows = []
    for incident in incidents:
        verdict = judge(incident, alarms)
        alarm = verdict.alarm
        rows.append({"incident": incident.kind, "bucket": incident.bucket,
                     "cohort": incident.cohort, "start_ts": incident.start_ts,
                     "expected_reason": incident.expected_reason,
                     "verdict": verdict.verdict,
                     **{k: getattr(alarm, k, None) for k in ("reason", "decision_id", "action")},
                     "decision_bucket": getattr(alarm, "bucket", None), "decision_cohort": getattr(alarm, "cohort", None),
                     "detection_delay_s": verdict.delay_s})
    return rows
