"""Decisions: what specwatch tells engines and routers to do with the speculative path."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .scope import Scope, scope_text

__all__ = ["Action", "Reason", "Decision", "decision_id", "decision_key"]

Action = Literal["reduce_draft_length", "disable_speculation", "invalidate_bundle", "restore",
                 "alert", "promote"]
Reason = Literal["acceptance_drop", "no_speedup", "draft_overhead", "latency_slo", "kv_pressure",
                 "bundle_changed", "quality_regression", "error_rate", "unadmitted_bundle",
                 "canary_judgement"]


class Decision(BaseModel):
    """One decision about the speculative path of a bundle, bucket or cohort.

    ``bucket=None`` means every bucket of the bundle, ``cohort=None`` every cohort.
    ``ts`` is the event time of the telemetry that tipped the decision.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Literal["decision"] = "decision"
    v: Literal[1] = 1
    ts: float = Field(ge=0, allow_inf_nan=False)
    bundle_id: str
    bucket: str | None = None
    cohort: str | None = None
    action: Action
    reason: Reason
    detector: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    sample_ids: list[str] = Field(default_factory=list)

    def to_json_line(self) -> str:
        """Canonical one-line JSON: field order fixed, keys of evidence sorted."""
        body = self.model_dump(mode="json")
        body["evidence"] = _sorted(body["evidence"])
        return json.dumps(body, separators=(",", ":"), allow_nan=False)

    @property
    def id(self) -> str:
        return decision_id(self)

    @property
    def scope(self) -> Scope:
        return self.bundle_id, self.bucket, self.cohort

    @property
    def key(self) -> str:
        return scope_text(self.scope)


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN has no JSON form
        return None
    return value


def decision_id(decision: Decision) -> str:
    """Stable id of a decision: a digest of its canonical line (same input, same id).

    >>> d = Decision(ts=12.5, bundle_id="b-1", bucket="coding", cohort=None,
    ...              action="disable_speculation", reason="quality_regression", detector="shadow")
    >>> decision_id(d)
    'd-1300a14fbe98'
    """
    return "d-" + hashlib.sha256(decision.to_json_line().encode()).hexdigest()[:12]


def decision_key(bundle_id: str, bucket: str | None, cohort: str | None) -> str:
    """The scope key of a decision: ``bundle/bucket/cohort`` with ``*`` for 'all'.

    >>> decision_key("b-1", "coding", None)
    'b-1/coding/*'
    """
    return scope_text((bundle_id, bucket, cohort))
