"""Where the gateway sends one request: its bucket and cohort (headers, a rule table, admission's
cohort share) and its pool (flag state, admission stage). Pure: no sockets, no clocks."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specwatch.actions.flags import AdmissionState, SpeculationState
from specwatch.schemas.contract import printable, scope_name_ok

__all__ = ["BUCKET_HEADER", "COHORT_HEADER", "DEFAULT_BUCKET", "DEFAULT_COHORT", "SPECULATIVE", "STANDARD",
           "LabelRule", "LabelRules", "Labels", "Route", "assign_labels", "choose_route", "mirrorable",
           "share_draw", "valid_label"]

BUCKET_HEADER = "x-specwatch-bucket"
COHORT_HEADER = "x-specwatch-cohort"
DEFAULT_BUCKET = "default"
DEFAULT_COHORT = "main"
SPECULATIVE = "speculative"
STANDARD = "standard"

# Labels become keys of windows, tables and flag scopes: short and printable, and never the
# wildcard or separator of decision scope keys.
_MAX_LABEL_CHARS = 64
_PATH_STEP = re.compile(r"[A-Za-z0-9_\-]+|\d+")


def valid_label(value: object) -> bool:
    """Whether a header or request field may name a bucket or cohort.

    >>> valid_label("coding"), valid_label("*"), valid_label("a/b"), valid_label("x\\x1b[1m"), valid_label(7)
    (True, False, False, False, False)
    """
    return (isinstance(value, str) and 0 < len(value) <= _MAX_LABEL_CHARS and printable(value)
            and scope_name_ok(value) and value.strip() == value)


def _json_path(body: Any, path: str) -> Any:
    """The value at a dotted path (``metadata.task``, ``messages.0.role``); None where it is absent.

    >>> _json_path({"metadata": {"task": "sql"}, "messages": [{"role": "system"}]}, "messages.0.role")
    'system'
    >>> _json_path({"metadata": None}, "metadata.task") is None
    True
    """
    value = body
    for step in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(step)
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            return None
    return value


class LabelRule(BaseModel):
    """One row of the rule table: every condition given must hold; the first matching row labels.

    ``json_path`` with ``equals`` is a condition; without it, the value found there is the bucket.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    route: str | None = Field(default=None, description="request path, e.g. /v1/chat/completions")
    model: str | None = Field(default=None, description="the request's model name")
    json_path: str | None = Field(default=None, description="dotted path into the request body")
    equals: str | int | float | bool | None = Field(default=None, description="value json_path must hold")
    bucket: str | None = None
    cohort: str | None = None

    @field_validator("json_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None and not all(_PATH_STEP.fullmatch(step) for step in value.split(".")):
            raise ValueError(f"json_path {value!r} must be dotted names or list indexes, e.g. metadata.task")
        return value

    @field_validator("bucket", "cohort")
    @classmethod
    def _label(cls, value: str | None) -> str | None:
        if value is not None and not valid_label(value):
            raise ValueError(f"{value!r} cannot name a bucket or cohort: 1-{_MAX_LABEL_CHARS} printable "
                             "characters, not '*', no '/'")
        return value

    def labels(self, route: str, body: Mapping[str, Any]) -> tuple[str | None, str | None] | None:
        """(bucket, cohort) this row gives the request, or None when it does not match."""
        if self.route is not None and route != self.route:
            return None
        if self.model is not None and body.get("model") != self.model:
            return None
        bucket = self.bucket
        if self.json_path is not None:
            found = _json_path(body, self.json_path)
            if self.equals is not None:
                if found != self.equals or type(found) is not type(self.equals):
                    return None
            elif bucket is None:
                if not valid_label(found):
                    return None
                bucket = found
        return bucket, self.cohort


class LabelRules(BaseModel):
    """The rule table (a TOML file's ``[[rule]]`` rows) and the headers that override it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: list[LabelRule] = Field(default_factory=list)
    bucket_header: str = BUCKET_HEADER
    cohort_header: str = COHORT_HEADER
    default_bucket: str = DEFAULT_BUCKET
    default_cohort: str = DEFAULT_COHORT


@dataclass(frozen=True)
class Labels:
    """A request's bucket and cohort, and whether its cohort was given (header or rule) or drawn."""

    bucket: str
    cohort: str
    cohort_given: bool


def share_draw(key: str) -> float:
    """A request's place in [0, 1) for cohort shares: the same key always draws the same place.

    >>> share_draw("req-1") == share_draw("req-1"), 0.0 <= share_draw("req-2") < 1.0
    (True, True)
    """
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64


def assign_labels(rules: LabelRules, route: str, headers: Mapping[str, str], body: Mapping[str, Any],
                  stage: AdmissionState | None, draw: float) -> Labels:
    """Bucket and cohort of one request: headers first, then the first matching rule, then defaults;
    an ungiven cohort is the admission stage's cohort for ``draw`` below its share, else the default.

    >>> rules = LabelRules(rule=[LabelRule(route="/v1/chat/completions", bucket="chat"),
    ...                          LabelRule(json_path="metadata.task")])
    >>> assign_labels(rules, "/v1/completions", {}, {"metadata": {"task": "sql"}}, None, 0.5)
    Labels(bucket='sql', cohort='main', cohort_given=False)
    >>> assign_labels(rules, "/v1/chat/completions", {"x-specwatch-cohort": "baseline"}, {}, None, 0.5)
    Labels(bucket='chat', cohort='baseline', cohort_given=True)
    >>> canary = AdmissionState("canary", "canary", 0.25)
    >>> [assign_labels(rules, "/v1/completions", {}, {}, canary, u).cohort for u in (0.1, 0.3)]
    ['canary', 'main']
    """
    bucket = headers.get(rules.bucket_header)
    cohort = headers.get(rules.cohort_header)
    bucket = bucket if valid_label(bucket) else None
    cohort = cohort if valid_label(cohort) else None
    if bucket is None or cohort is None:
        for rule in rules.rule:
            found = rule.labels(route, body)
            if found is not None:
                bucket = bucket or found[0]
                cohort = cohort or found[1]
                break
    given = cohort is not None
    if cohort is None:
        cohort = rules.default_cohort
        if stage is not None and stage.stage in ("shadow", "canary") and stage.cohort and draw < stage.cohort_share:
            cohort = stage.cohort
    return Labels(bucket or rules.default_bucket, cohort, given)


@dataclass(frozen=True)
class Route:
    """Which pool answers the client, why (a label of the gateway's metrics), and whether a copy
    goes to the speculative pool to be compared (shadow)."""

    pool: str
    reason: str
    mirror: bool = False


def choose_route(state: SpeculationState, stage: AdmissionState | None, cohort: str, *,
                 speculative_up: bool, baseline_cohort: str, shadow_cohort: str) -> Route:
    """The pool for a request of ``cohort`` given the flag state of its scope and its bundle's stage.

    In shadow the stage's cohort is answered by the standard pool and mirrored to the speculative
    one (while its ``/metrics`` answers). A failing speculative pool is routed around by the error
    gate's decision, not here: until it decides, the gateway retries. A draft-length limit cannot be
    imposed on an unmodified server, so it leaves the route as is.

    >>> on = SpeculationState(True)
    >>> choose_route(on, None, "main", speculative_up=True, baseline_cohort="baseline",
    ...              shadow_cohort="shadow")
    Route(pool='speculative', reason='speculating', mirror=False)
    >>> off = SpeculationState(False, reasons=("acceptance_drop",))
    >>> choose_route(off, None, "main", speculative_up=True, baseline_cohort="baseline",
    ...              shadow_cohort="shadow").reason
    'acceptance_drop'
    >>> shadow = AdmissionState("shadow", "shadow", 0.05)
    >>> choose_route(on, shadow, "shadow", speculative_up=True, baseline_cohort="baseline",
    ...              shadow_cohort="shadow")
    Route(pool='standard', reason='shadow', mirror=True)
    """
    if cohort == baseline_cohort:
        return Route(STANDARD, "baseline_cohort")
    if stage is not None and stage.stage == "shadow" and cohort == (stage.cohort or shadow_cohort):
        return Route(STANDARD, "shadow", mirror=speculative_up)
    if not state.enabled:
        return Route(STANDARD, state.reasons[0] if state.reasons else "speculation_off")
    return Route(SPECULATIVE, "speculating")


def mirrorable(body: Mapping[str, Any]) -> bool:
    """Whether a mirrored copy can be compared token for token: greedy and a single choice.

    >>> mirrorable({"temperature": 0}), mirrorable({"temperature": 0.7}), mirrorable({"temperature": 0, "n": 2})
    (True, False, False)
    """
    temperature = body.get("temperature", 1.0)
    return (isinstance(temperature, (int, float)) and temperature == 0 and body.get("n", 1) in (1, None)
            and not body.get("best_of"))

