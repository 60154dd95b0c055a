"""Incidents are matched with the first decision that took speculation away for them (the demo's table)."""

from types import SimpleNamespace

from specwatch.lab.evaluation.scoring import decision_alarm, match_incidents
from specwatch.schemas import Decision


def _decision(ts, action, reason="canary_judgement", bucket=None):
    return Decision(ts=ts, bundle_id="b-1", bucket=bucket, cohort=None, action=action, reason=reason,
                    detector="canary_judge", evidence={})


def test_a_promotion_does_not_count_as_catching_a_canary_incident():
    incident = SimpleNamespace(kind="canary_tail", bucket="structured", cohort="canary", start_ts=100.0,
                               expected_reason="canary_judgement", bundle_id="b-1")
    freeze = _decision(281.0, "disable_speculation")
    decisions = [_decision(117.0, "promote"), _decision(200.0, "restore"), freeze]
    rows = match_incidents([incident], [decision_alarm(d) for d in decisions])
    # the freeze acts on the whole bundle, the incident was in one bucket: caught, more broadly than needed
    assert (rows[0]["decision_id"], rows[0]["action"], rows[0]["detection_delay_s"], rows[0]["verdict"]) == (
        freeze.id, "disable_speculation", 181.0, "wrong scope")


def test_giving_speculation_back_is_neither_an_answer_nor_a_false_alarm():
    from specwatch.lab.evaluation.scoring import stray_alarms

    incident = SimpleNamespace(kind="acceptance_drop", bucket="coding", cohort=None, start_ts=100.0,
                               expected_reason="acceptance_drop", bundle_id="b-1", workers=())
    restore = _decision(150.0, "restore", reason="acceptance_drop", bucket="coding")
    promote = _decision(50.0, "promote", reason="unadmitted_bundle")
    off = _decision(170.0, "disable_speculation", reason="latency_slo", bucket="coding")
    alarms = [decision_alarm(d) for d in (promote, restore, off)]
    row, = match_incidents([incident], alarms)
    assert (row["verdict"], row["decision_id"], row["detection_delay_s"]) == ("wrong reason", off.id, 70.0)
    assert [a.decision_id for a in stray_alarms([incident], alarms)] == [off.id]
