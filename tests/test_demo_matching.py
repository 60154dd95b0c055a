"""The demo pairs each incident with the first decision that took speculation away for it."""

from types import SimpleNamespace

from specwatch.commands.demo import match_incidents
from specwatch.schemas import Decision


def _decision(ts, action, reason="canary_judgement", bucket=None):
    return Decision(ts=ts, bundle_id="b-1", bucket=bucket, cohort=None, action=action, reason=reason,
                    detector="canary_judge", evidence={})


def test_a_promotion_does_not_count_as_catching_a_canary_incident():
    incident = SimpleNamespace(kind="canary_tail", bucket="structured", cohort="canary", start_ts=100.0,
                               expected_reason="canary_judgement", bundle_id="b-1")
    freeze = _decision(281.0, "disable_speculation")
    rows = match_incidents([incident], [_decision(117.0, "promote"), _decision(200.0, "restore"), freeze])
    assert (rows[0]["decision_id"], rows[0]["action"], rows[0]["detection_delay_s"]) == (
        freeze.id, "disable_speculation", 181.0)
