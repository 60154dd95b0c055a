"""Alertmanager in both directions: decisions out as alerts (`AlertSender`), firing alerts in as
rollbacks (`read_webhook`); docs/OPERATIONS.md says how each behaves."""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Mapping, get_args

from pydantic import TypeAdapter, ValidationError

from specwatch.schemas import Decision
from specwatch.schemas.config_files import read_config_file
from specwatch.schemas.contract import DraftLength, Name, ScopeName, Text
from specwatch.schemas.decisions import Reason
from specwatch.schemas.scope import EVERY

__all__ = ["ALERTMANAGER_URL_ENV", "SENDER_RESULTS", "WEBHOOK_DETECTOR", "WEBHOOK_OUTCOMES", "WEBHOOK_TOKEN_FILE_ENV",
           "AlertRequest", "AlertSender", "RollbackPolicy", "WebhookLedger", "WebhookReading",
           "alert_problem", "bearer_token_ok", "decision_alert", "let_go_decision", "load_rollback_policy",
           "read_token_file", "read_webhook", "resolve_scopes"]

# What a sender does with an alert, and what the webhook does with one it receives: the
# label values of specwatch_alertmanager_alerts_total and specwatch_webhook_alerts_total.
SENDER_RESULTS = ("sent", "failed", "dropped", "resolved")
WEBHOOK_OUTCOMES = ("applied", "duplicate", "no_scope", "unknown_scope", "no_reason", "not_restored",
                    "invalid_alert", "not_held", "still_held")

logger = logging.getLogger(__name__)

ALERTMANAGER_URL_ENV = "SPECWATCH_ALERTMANAGER_URL"
WEBHOOK_TOKEN_FILE_ENV = "SPECWATCH_WEBHOOK_TOKEN_FILE"
ALERT_NAME = "SpecwatchDecision"
_DEFAULT_QUEUE = 1000
_DEFAULT_RESEND_S = 60.0
_DEFAULT_TIMEOUT_S = 5.0
_DEFAULT_RETRIES = 5
_DEFAULT_BACKOFF_S = 0.5
# Idempotence memory of the webhook: alerts (fingerprint, startsAt, status) handled.
_LEDGER_SIZE = 10_000
_TAKING_AWAY = ("disable_speculation", "invalidate_bundle", "reduce_draft_length")
_REASON_CODES = get_args(Reason)
# The detector webhook rollbacks carry: how an archived one is told from the others after a restart.
WEBHOOK_DETECTOR = "alertmanager"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decision_alert(decision: Decision, now: float, ends_at: float, explain_archive: str | None = None) -> dict:
    """One Alertmanager v2 alert for ``decision``, in force until ``ends_at`` (unix seconds).

    >>> d = Decision(ts=10.0, bundle_id="b-1", bucket="coding", cohort=None, action="disable_speculation",
    ...              reason="acceptance_drop", detector="acceptance_gate")
    >>> alert = decision_alert(d, now=100.0, ends_at=400.0)
    >>> alert["labels"]
    {'alertname': 'SpecwatchDecision', 'bundle': 'b-1', 'bucket': 'coding', 'cohort': '*', 'action': 'disable_speculation', 'reason': 'acceptance_drop', 'severity': 'page'}
    >>> alert["annotations"]["explain"] == f"specwatch explain {d.id}", alert["endsAt"]
    (True, '1970-01-01T00:06:40.000000Z')
    """
    labels = {"alertname": ALERT_NAME, "bundle": decision.bundle_id,
              "bucket": decision.bucket or EVERY, "cohort": decision.cohort or EVERY,
              "action": decision.action, "reason": decision.reason,
              "severity": "page" if decision.action in ("disable_speculation", "invalidate_bundle") else "ticket"}
    explain = f"specwatch explain {decision.id}"
    if explain_archive:
        explain += f" --archive {explain_archive}"
    return {
        "labels": labels,
        "annotations": {
            "decision_id": decision.id,
            "summary": f"specwatch {decision.action} on {decision.key}: {decision.reason} ({decision.detector})",
            "explain": explain,
        },
        "startsAt": _iso(min(decision.ts, now)),
        "endsAt": _iso(ends_at),
    }


class AlertSender:
    """Posts decisions to Alertmanager (POST /api/v2/alerts) from a background thread; `submit`
    never blocks (a full queue drops and counts), failed posts are retried, then counted. Alerts in
    force are sent again every ``resend_seconds``, each with ``endsAt`` four intervals ahead;
    ``post(url, body_bytes, timeout)`` is urllib's by default."""

    def __init__(self, url: str, *, queue_size: int = _DEFAULT_QUEUE, resend_seconds: float = _DEFAULT_RESEND_S,
                 retries: int = _DEFAULT_RETRIES, backoff_s: float = _DEFAULT_BACKOFF_S,
                 explain_archive: str | None = None,
                 post: Callable[[str, bytes, float], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Alertmanager URL must start with http:// or https://, got {url!r}")
        if not resend_seconds > 0 or queue_size < 1 or retries < 0:
            raise ValueError("resend_seconds must be > 0, queue_size >= 1 and retries >= 0")
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.resend_seconds = resend_seconds
        self._retries = retries
        self._backoff_s = backoff_s
        self._explain_archive = explain_archive
        self._post = post or _http_post
        self._clock = clock
        self._queue: queue.Queue[Decision] = queue.Queue(maxsize=queue_size)
        self._active: dict[tuple, dict[tuple, Decision]] = {}  # scope -> alert labels -> decision
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # every result from the start at 0: Prometheus' increase() needs the series before its first event
        self.counts: Counter = Counter(dict.fromkeys(SENDER_RESULTS, 0))

    def submit(self, decision: Decision) -> bool:
        """Queue one decision; False (and counted as dropped) when the queue is full."""
        if decision.action not in (*_TAKING_AWAY, "restore"):
            return True  # alerts and promotions change no path: nothing to page about
        try:
            self._queue.put_nowait(decision)
            return True
        except queue.Full:
            self.counts["dropped"] += 1
            return False

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> "AlertSender":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specwatch-alertmanager", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        next_resend = self._clock() + self.resend_seconds
        while not self._stop.is_set():
            batch: list[Decision] = []
            try:
                batch.append(self._queue.get(timeout=min(1.0, self.resend_seconds)))
                while len(batch) < 100:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if batch:
                self.send_now(batch)
            if self._clock() >= next_resend:
                self.resend()
                next_resend = self._clock() + self.resend_seconds

    def send_now(self, decisions: Iterable[Decision]) -> None:
        """Fold decisions into the alerts in force and post what changed (the thread's work)."""
        now = self._clock()
        alerts = []
        for decision in decisions:
            scope = (decision.bundle_id, decision.bucket, decision.cohort)
            if decision.action == "restore":
                for old in self._active.pop(scope, {}).values():
                    alerts.append(decision_alert(old, now, now, self._explain_archive))
                    self.counts["resolved"] += 1
                continue
            alert = decision_alert(decision, now, now + 4 * self.resend_seconds, self._explain_archive)
            self._active.setdefault(scope, {})[tuple(sorted(alert["labels"].items()))] = decision
            alerts.append(alert)
        self._deliver(alerts)

    def resend(self) -> None:
        now = self._clock()
        self._deliver([decision_alert(d, now, now + 4 * self.resend_seconds, self._explain_archive)
                       for by_labels in self._active.values() for d in by_labels.values()])

    def _deliver(self, alerts: list[dict]) -> None:
        if not alerts:
            return
        body = json.dumps(alerts).encode()
        for attempt in range(self._retries + 1):
            try:
                self._post(self.url, body, _DEFAULT_TIMEOUT_S)
                self.counts["sent"] += len(alerts)
                return
            except Exception as error:  # noqa: BLE001 - any failure is retried, then counted
                if attempt == self._retries or self._stop.wait(self._backoff_s * 2 ** attempt):
                    self.counts["failed"] += len(alerts)
                    logger.warning("Alertmanager at %s did not take %d alerts: %s", self.url, len(alerts), error)
                    return


def _http_post(url: str, body: bytes, timeout: float) -> None:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status >= 300:
            raise urllib.error.HTTPError(url, response.status, response.reason, response.headers, None)


@dataclass(frozen=True)
class RollbackPolicy:
    """How firing alerts become rollbacks: ``reasons`` maps alert names to contract reasons (for
    alerts without a ``reason`` label); ``restore_on_resolve`` names alerts (``"*"``: every one)
    whose resolution restores the scope they disabled."""

    reasons: Mapping[str, str] = field(default_factory=dict)
    restore_on_resolve: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        bad = {name: code for name, code in self.reasons.items() if code not in _REASON_CODES}
        if bad:
            raise ValueError(f"alert reasons must be contract reason codes ({', '.join(_REASON_CODES)}), got {bad}")

    def restores(self, alertname: str) -> bool:
        return "*" in self.restore_on_resolve or alertname in self.restore_on_resolve


_MAX_POLICY_BYTES = 1 << 20  # a rollback policy is a few lines; anything near this is not one
_MAX_TOKEN_BYTES = 4096  # a bearer token, not a file that happens to be at that path


def load_rollback_policy(path: str | Path | None) -> RollbackPolicy:
    """Read a rollback policy TOML file (``restore_on_resolve`` and ``[reasons]``; None: empty)."""
    if path is None:
        return RollbackPolicy()
    try:
        data = tomllib.loads(read_config_file(path, _MAX_POLICY_BYTES).decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read the rollback policy {path}: {error}") from error
    unknown = set(data) - {"reasons", "restore_on_resolve"}
    if unknown:
        raise ValueError(f"rollback policy {path}: unknown settings {sorted(unknown)}; "
                         "allowed: reasons, restore_on_resolve")
    restore = data.get("restore_on_resolve", [])
    if not isinstance(restore, list) or not all(isinstance(n, str) for n in restore):
        raise ValueError(f"rollback policy {path}: restore_on_resolve must be a list of alert names")
    return RollbackPolicy(dict(data.get("reasons", {})), frozenset(restore))


def read_token_file(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed); ValueError when empty or unreadable."""
    try:
        token = read_config_file(path, _MAX_TOKEN_BYTES).decode().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the webhook token file {path}: {error}") from error
    if not token:
        raise ValueError(f"the webhook token file {path} is empty")
    return token


def bearer_token_ok(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time compare).

    >>> bearer_token_ok("Bearer s3cret", "s3cret"), bearer_token_ok("Bearer nope", "s3cret"), bearer_token_ok(None, "x")
    (True, False, False)
    """
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


@dataclass(frozen=True)
class AlertRequest:
    """What one alert of a webhook asks: disable (or restore) ``scope`` for ``reason``; a resolved
    alert that other alerts (``held_by``, their fingerprints) still hold the scope off for only lets go."""

    scope: tuple[str, str | None, str | None]
    restore: bool
    reason: str
    draft_limit: int | None
    audit: dict
    ident: tuple = ()
    held_by: tuple[str, ...] = ()


def let_go_decision(request: AlertRequest, ts: float, by: str) -> Decision:
    """The record of a resolved alert that lets go of a scope other alerts still hold off: an
    ``alert`` (no path changes) naming them. Published and archived like every webhook decision,
    so the letting go outlives a restart and the last holder's resolution still restores.

    >>> request = AlertRequest(("b-1", "coding", None), True, "latency_slo", None,
    ...                        {"alertname": "Drill", "fingerprint": "f1", "status": "resolved"}, (), ("f2",))
    >>> d = let_go_decision(request, 100.0, "alertmanager")
    >>> d.action, d.key, d.detector, d.evidence["held_by"], d.evidence["note"]
    ('alert', 'b-1/coding/*', 'alertmanager', ['f2'], 'alert Drill resolved; still held off by 1 other alert')
    """
    bundle, bucket, cohort = request.scope
    others = len(request.held_by)
    note = (f"alert {request.audit['alertname']} {request.audit['status']}; still held off by {others} other "
            f"alert{'s' if others > 1 else ''}")
    evidence = {"by": by, "note": note, "cleared": False, "held_by": sorted(request.held_by), **request.audit}
    return Decision(ts=ts, bundle_id=bundle, bucket=bucket, cohort=cohort, action="alert", reason=request.reason,
                    detector=WEBHOOK_DETECTOR, evidence=evidence)


def resolve_scopes(labels: Mapping[str, str], cards: Mapping[str, dict]) -> list[tuple[str, str | None, str | None]]:
    """The scopes an alert's labels (``bundle``, or vLLM's ``model_name`` matching a card's
    ``target.model_id``; ``bucket``, ``cohort``) name among known bundles (``cards``).

    >>> cards = {"b-1": {"target": {"model_id": "llama"}}, "b-2": {"target": {"model_id": "llama"}}}
    >>> resolve_scopes({"model_name": "llama", "bucket": "coding"}, cards)
    [('b-1', 'coding', None), ('b-2', 'coding', None)]
    >>> resolve_scopes({"bundle": "b-9"}, cards)
    []
    """
    bucket, cohort = (None if labels.get(name) in (None, "", "*") else labels[name]
                      for name in ("bucket", "cohort"))
    if labels.get("bundle"):
        bundles = [labels["bundle"]] if labels["bundle"] in cards else []
    elif labels.get("model_name"):
        bundles = sorted(b for b, card in cards.items()
                         if (card or {}).get("target", {}).get("model_id") == labels["model_name"])
    else:
        bundles = []
    return [(bundle, bucket, cohort) for bundle in bundles]


# The contract's own rules for what reaches a decision from an alert: names as telemetry names a
# bundle, bucket or cohort, the draft length as a card names it.
_NAME = TypeAdapter(Name)
_SCOPE_NAME = TypeAdapter(ScopeName)
_DRAFT_LENGTH = TypeAdapter(DraftLength)
_TEXT = TypeAdapter(Text)
_NAMED_LABELS = ("alertname", "bundle", "model_name", "reason")
_SCOPE_LABELS = ("bucket", "cohort")


def alert_problem(alert: Mapping, labels: Mapping[str, str]) -> str | None:
    """Why an alert cannot become a decision (a label or field the contract refuses), or None.

    >>> ok = {"fingerprint": "f1", "startsAt": "2026-12-01T10:00:00.123456789Z"}
    >>> alert_problem(ok, {"alertname": "A", "bundle": "b-1", "bucket": "*", "draft_length": "2"}) is None
    True
    >>> alert_problem(ok, {"alertname": "A", "bundle": "b-1", "draft_length": "-1"})
    "label draft_length: '-1' is not a draft length (1 to 64)"
    >>> alert_problem(dict(ok, startsAt="not-a-time"), {"alertname": "A", "bundle": "b-1"})
    "startsAt: 'not-a-time' is not an RFC 3339 time with a zone"
    """
    for name in (*_NAMED_LABELS, *_SCOPE_LABELS, "draft_length"):
        value = labels.get(name)
        if value is None or (name in _SCOPE_LABELS and value in ("", "*")):
            continue
        try:
            if name == "draft_length":
                # a label is text: only plain decimal digits, no sign, no spaces, then the card's range
                if not (value.isascii() and value.isdigit() and len(value) <= 2):
                    raise ValueError
                _DRAFT_LENGTH.validate_python(int(value))
            else:
                (_SCOPE_NAME if name in _SCOPE_LABELS else _NAME).validate_python(value)
        except (ValueError, ValidationError):
            what = "a draft length (1 to 64)" if name == "draft_length" else "a name the contract takes"
            return f"label {name}: {value[:64]!r} is not {what}"
    for name, adapter in (("fingerprint", _NAME), ("generatorURL", _TEXT)):
        value = alert.get(name)
        if value is None and name == "generatorURL":
            continue
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            return f"{name}: {str(value)[:64]!r} is not a name the contract takes"
    for name in ("startsAt", "endsAt"):
        if name == "endsAt" and alert.get(name) is None:
            continue
        if _parse_time(alert.get(name)) is None:
            return f"{name}: {str(alert.get(name))[:64]!r} is not an RFC 3339 time with a zone"
    return None


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


class WebhookLedger:
    """Alerts already handled, by (fingerprint, startsAt, status), recorded once their decisions
    are published: a re-sent alert changes nothing, a retried failed one is handled in full. It
    also knows which alerts (by fingerprint) hold each scope off, so a resolved alert restores
    only a scope it turned off itself and no other alert still holds. All of it is rebuilt from
    the webhook's own decisions (`remember`), the letting go of a scope included.

    >>> ledger = WebhookLedger(size=1)
    >>> ledger.handled(("f1", "t", "firing")), ledger.record(("f1", "t", "firing")), ledger.handled(("f1", "t", "firing"))
    (False, None, True)
    >>> ledger.hold("f1", ("b-1", None, None)); ledger.hold("f2", ("b-1", None, None))
    >>> sorted(ledger.holders(("b-1", None, None))), ledger.release("f1", ("b-1", None, None))
    (['f1', 'f2'], {'f2'})
    """

    def __init__(self, size: int = _LEDGER_SIZE) -> None:
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._size = size
        self._holders: dict[tuple, set[str]] = {}

    def handled(self, ident: tuple) -> bool:
        return ident in self._seen

    def record(self, ident: tuple) -> None:
        self._seen[ident] = None
        self._seen.move_to_end(ident)
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)

    def holders(self, scope: tuple) -> set[str]:
        """Fingerprints of the alerts that turned ``scope`` off (or lowered its D) and hold it so."""
        return set(self._holders.get(scope, ()))

    def hold(self, fingerprint: str, scope: tuple) -> None:
        self._holders.setdefault(scope, set()).add(fingerprint)

    def release(self, fingerprint: str, scope: tuple) -> set[str]:
        """Forget that ``fingerprint`` holds ``scope``; returns the alerts that still hold it."""
        held = self._holders.get(scope, set())
        held.discard(fingerprint)
        if not held:
            self._holders.pop(scope, None)
        return set(held)

    def applied(self, request: AlertRequest) -> None:
        """``request`` was published: remember it, and who holds its scope now."""
        self.record(request.ident)
        if request.held_by:
            self.release(request.audit["fingerprint"], request.scope)
        elif request.restore:
            # a restore goes out only once its alert is the last to hold the scope: none holds it now
            self._holders.pop(request.scope, None)
        else:
            self.hold(request.audit["fingerprint"], request.scope)

    def remember(self, decisions: Iterable[Decision]) -> int:
        """Fold earlier webhook decisions (detector ``alertmanager``, oldest first, e.g. from the
        archive after a restart) back in; returns how many were taken."""
        taken = 0
        for decision in decisions:
            evidence = decision.evidence
            if decision.detector != WEBHOOK_DETECTOR or not isinstance(evidence.get("fingerprint"), str):
                continue
            status = evidence.get("status")
            # an alert decision of the webhook is a resolved alert that let go while others held on
            held_by = tuple(evidence.get("held_by") or ("?",)) if decision.action == "alert" else ()
            self.applied(AlertRequest((decision.bundle_id, decision.bucket, decision.cohort), status == "resolved",
                                      decision.reason, None, {"fingerprint": evidence["fingerprint"]},
                                      (evidence["fingerprint"], evidence.get("starts_at"), status), held_by))
            taken += 1
        return taken


@dataclass
class WebhookReading:
    """What one webhook payload asks: the rollbacks, every alert counted by outcome
    (`WEBHOOK_OUTCOMES`), and why each refused alert was refused."""

    requests: list[AlertRequest] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    refused: list[dict] = field(default_factory=list)


def read_webhook(payload: object, cards: Mapping[str, dict], policy: RollbackPolicy,
                 ledger: WebhookLedger) -> WebhookReading:
    """The rollbacks one webhook payload (version 4, else ValueError) asks for; call
    ``ledger.applied`` for each once published. A bad alert is refused alone, with its reason."""
    if not isinstance(payload, dict) or str(payload.get("version")) != "4" or not isinstance(
            payload.get("alerts"), list):
        raise ValueError("not an Alertmanager webhook payload (version 4 with an alerts list)")
    reading = WebhookReading()
    outcomes, seen = reading.outcomes, set()
    for alert in payload["alerts"]:
        if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
            outcomes["no_scope"] += 1
            continue
        labels = {str(k): v if isinstance(v, str) else str(v) for k, v in alert["labels"].items()}
        status = alert.get("status") or payload.get("status")
        name = labels.get("alertname", "")
        if not (labels.get("bundle") or labels.get("model_name")):
            outcomes["no_scope"] += 1
            continue
        problem = alert_problem(alert, labels) or (
            None if status in ("firing", "resolved") else f"status: {str(status)[:64]!r} is not firing or resolved")
        if problem is not None:
            outcomes["invalid_alert"] += 1
            reading.refused.append({"fingerprint": str(alert.get("fingerprint"))[:64], "alertname": name[:64],
                                    "reason": problem})
            continue
        scopes = resolve_scopes(labels, cards)
        if not scopes:
            outcomes["unknown_scope"] += 1
            continue
        reason = labels.get("reason") if labels.get("reason") in _REASON_CODES else policy.reasons.get(name)
        if reason is None:
            outcomes["no_reason"] += 1
            continue
        restore = status == "resolved"
        if restore and not policy.restores(name):
            outcomes["not_restored"] += 1
            continue
        ident = (alert["fingerprint"], alert["startsAt"], status)
        if ledger.handled(ident) or ident in seen:
            outcomes["duplicate"] += 1
            continue
        seen.add(ident)
        held_by: dict[tuple, tuple[str, ...]] = {}
        if restore:
            # only what this alert turned off, and only once no other alert holds it off
            held = [scope for scope in scopes if alert["fingerprint"] in ledger.holders(scope)]
            if not held:
                outcomes["not_held"] += 1
                continue
            held_by = {scope: tuple(sorted(ledger.holders(scope) - {alert["fingerprint"]})) for scope in held}
            scopes = held
        limit = labels.get("draft_length")
        audit = {"alertname": name, "fingerprint": alert["fingerprint"],
                 "generator_url": alert.get("generatorURL"), "starts_at": alert["startsAt"],
                 "status": status}
        for scope in scopes:
            # where others hold the scope off, this one lets go (a record of it, no path change)
            reading.requests.append(AlertRequest(scope, restore, reason, int(limit) if limit else None, audit, ident,
                                                 held_by.get(scope, ())))
        outcomes["still_held" if held_by and all(held_by.values()) else "applied"] += 1
    return reading
