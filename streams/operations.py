"""A worker's operations surface: /metrics, /healthz, /readyz and the Alertmanager webhook."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specwatch.actions.sinks.alertmanager import (
    WEBHOOK_DETECTOR,
    WEBHOOK_OUTCOMES,
    AlertSender,
    RollbackPolicy,
    WebhookLedger,
    bearer_token_ok,
    let_go_decision,
    read_webhook,
)
from specwatch.actions.flags import OverrideChange, override_decision
from specwatch.schemas import Decision
from specwatch.schemas.outputs import ActionRecord

from .metrics import MetricsCollector, MetricsView, ServiceHealth

__all__ = ["OperationsSettings", "Operations", "WEBHOOK_PATH", "read_body"]

logger = logging.getLogger(__name__)

WEBHOOK_PATH = "/alertmanager/webhook"
_WEBHOOK_BY = "alertmanager"
# Alertmanager's largest group (its webhook_config max_alerts caps it) fits many times over;
# past it a request is refused unread rather than buffered.
_MAX_WEBHOOK_BYTES = 4 << 20
# Why each alert of a payload was refused goes back in the reply, up to this many.
_MAX_REFUSALS_REPLIED = 100


@dataclass(frozen=True)
class OperationsSettings:
    """Metrics, Alertmanager and webhook settings of a worker."""

    web_port: int | None = 6066
    web_bind: str = "0.0.0.0"
    max_metric_keys: int = 2000
    alertmanager_url: str | None = None
    alertmanager_resend_seconds: float = 60.0
    webhook_token: str | None = field(default=None, repr=False)
    rollback: RollbackPolicy = field(default_factory=RollbackPolicy)
    explain_archive: str | None = None

    def __post_init__(self) -> None:
        if self.web_port is not None and not 0 < self.web_port < 65536:
            raise ValueError(f"web port must be between 1 and 65535, got {self.web_port}")
        if self.max_metric_keys < 1:
            raise ValueError(f"max_metric_keys must be >= 1, got {self.max_metric_keys}")


class Operations:
    """Metrics view, Alertmanager sender and webhook of one worker (or of the demo)."""

    def __init__(self, settings: OperationsSettings, health: Callable[[], ServiceHealth] = ServiceHealth,
                 clock: Callable[[], float] = time.time, stages: Callable[[], Iterable] = tuple) -> None:
        self.settings = settings
        self.clock = clock
        self.view = MetricsView(stages, max_keys=settings.max_metric_keys)
        self.sender = (AlertSender(settings.alertmanager_url, resend_seconds=settings.alertmanager_resend_seconds,
                                   explain_archive=settings.explain_archive)
                       if settings.alertmanager_url else None)
        self.ledger = WebhookLedger()
        self._webhook_lock = asyncio.Lock()
        # every outcome from the start at 0: Prometheus' increase() needs the series before its first event
        self.webhook_alerts: Counter = Counter(dict.fromkeys(WEBHOOK_OUTCOMES, 0))
        self.webhook_requests: Counter = Counter()  # HTTP status -> requests
        self.health = health
        self.registry = CollectorRegistry(auto_describe=False)  # its own, not the process-wide one
        self.registry.register(MetricsCollector(self.view, self._full_health, clock))

    def _full_health(self) -> ServiceHealth:
        health = self.health()
        counters = dict(health.extra_counters)
        counters["specwatch_webhook_alerts"] = (
            "Alerts received on the Alertmanager webhook, by outcome", "outcome",
            self.webhook_alerts)
        counters["specwatch_webhook_requests"] = (
            "Requests to the Alertmanager webhook, by HTTP status", "status", self.webhook_requests)
        if self.sender is not None:
            counters["specwatch_alertmanager_alerts"] = (
                "Alerts posted to Alertmanager, by result (sent, failed, dropped, resolved)",
                "result", self.sender.counts)
        health.extra_counters = counters
        return health

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start(self) -> None:
        if self.sender is not None:
            self.sender.start()

    def stop(self) -> None:
        if self.sender is not None:
            self.sender.stop()

    def published(self, decisions: list[Decision]) -> None:
        """Decisions the decisions topic acknowledged: timed, and sent on to Alertmanager."""
        now = self.clock()
        for decision in decisions:
            self.view.published(decision.ts, now)
            if self.sender is not None:
                self.sender.submit(decision)

    def install(self, app: Any, ready: Callable[[], bool], cards: Callable[[], dict],
                publish: Callable[[list[Decision]], Any], automatic: Callable[[tuple], Any],
                archive: Callable[[list[ActionRecord]], Any] | None = None) -> None:
        """Add /metrics, /healthz, /readyz and the webhook to ``app`` (a `faust.App`); ``archive``
        takes every published rollback with its audit row."""
        from faust.web import View

        operations = self

        class MetricsPage(View):
            async def get(self, request):
                return self.bytes(operations.render(),
                                  headers={"Content-Type": CONTENT_TYPE_LATEST})

        class HealthPage(View):
            async def get(self, request):
                return self.json({"status": "ok"})

        class ReadyPage(View):
            async def get(self, request):
                ok = ready()
                return self.json({"ready": ok}, status=200 if ok else 503)

        class WebhookPage(View):
            async def post(self, request):
                if (request.content_length or 0) > _MAX_WEBHOOK_BYTES:  # refused by its declared size, unread
                    status, reply = operations.refuse_oversize(request.headers.get("Authorization"))
                else:
                    body = await read_body(request.content, _MAX_WEBHOOK_BYTES + 1)
                    status, reply = await operations.webhook(request.headers.get("Authorization"), body,
                                                             cards(), publish, automatic, archive)
                return self.json(reply, status=status)

        for path, view in (("/metrics", MetricsPage), ("/healthz", HealthPage), ("/readyz", ReadyPage),
                           (WEBHOOK_PATH, WebhookPage)):
            view.view_name = path.strip("/").replace("/", "_")
            view.view_path = path
            app.web.add_view(view)

    def refuse_oversize(self, authorization: str | None) -> tuple[int, dict]:
        """The answer to a body over the limit: who may not post hears that first."""
        # 413, not 5xx: Alertmanager retries a 5xx, and the same group will not get smaller; its
        # webhook_config max_alerts is what keeps a group under the limit.
        status, reply = self._unauthorized(authorization) or (
            413, {"error": f"payload over {_MAX_WEBHOOK_BYTES} bytes"})
        self.webhook_requests[status] += 1
        return status, reply

    def _unauthorized(self, authorization: str | None) -> tuple[int, dict] | None:
        token = self.settings.webhook_token
        if token is None:
            return 403, {"error": "the webhook is off: start the worker with --webhook-token-file"}
        if not bearer_token_ok(authorization, token):
            return 401, {"error": "missing or wrong bearer token (Alertmanager http_config.authorization)"}
        return None

    def remember(self, decisions: Iterable[Decision]) -> int:
        """Fold the webhook's earlier rollbacks (from the archive, oldest first) into its ledger, so
        that after a restart a re-sent alert is still a duplicate and a resolved one restores only
        what it turned off; returns how many were taken."""
        return self.ledger.remember(decisions)

    async def webhook(self, authorization: str | None, body: bytes, cards: dict,
                      publish: Callable[[list[Decision]], Any], automatic: Callable[[tuple], Any],
                      archive: Callable[[list[ActionRecord]], Any] | None = None) -> tuple[int, dict]:
        """Handle one webhook request; returns (HTTP status, JSON body)."""
        if len(body) > _MAX_WEBHOOK_BYTES:
            return self.refuse_oversize(authorization)
        try:
            # One request at a time from reading the ledger to recording in it: the same alert
            # posted many times at once is decided once (the others wait, then find it handled).
            async with self._webhook_lock:
                status, reply = await self._webhook(authorization, body, cards, publish, automatic, archive)
        except Exception as error:  # noqa: BLE001 - the broker did not take the decisions; Alertmanager retries 5xx
            logger.error("alert rollback not published: %s", error)
            status, reply = 503, {"error": f"the decisions topic did not take the rollback: {error}"}
        self.webhook_requests[status] += 1
        return status, reply

    async def _webhook(self, authorization, body, cards, publish, automatic, archive) -> tuple[int, dict]:
        refused = self._unauthorized(authorization)
        if refused is not None:
            return refused
        try:
            reading = read_webhook(json.loads(body), cards, self.settings.rollback, self.ledger)
        except (ValueError, RecursionError) as error:
            # 400, not 5xx: a body that does not parse (or nests past the parser's depth) parses no
            # better when Alertmanager sends it again, and a 5xx would have it retried for hours.
            what = "JSON nested too deep" if isinstance(error, RecursionError) else str(error)[:300]
            return 400, {"error": what}
        self.webhook_alerts.update(reading.outcomes)
        for refusal in reading.refused:
            logger.warning("alert %s (fingerprint %s) refused: %s", ascii(refusal["alertname"]),
                           ascii(refusal["fingerprint"]), refusal["reason"])
        now = self.clock()
        records = []
        for request in reading.requests:
            if request.held_by:
                records.append(ActionRecord(let_go_decision(request, now, _WEBHOOK_BY),
                                            dict(request.audit, by=_WEBHOOK_BY), []))
                continue
            bundle, bucket, cohort = request.scope
            note = f"alert {request.audit['alertname']} {request.audit['status']}"
            change = OverrideChange(bundle, bucket, cohort, enabled=request.draft_limit is not None,
                                    draft_limit=request.draft_limit, by=_WEBHOOK_BY, reason=note, ts=now,
                                    cleared=request.restore)
            decision = override_decision(change, request.reason,
                                         automatic(request.scope) if request.restore else None,
                                         detector=WEBHOOK_DETECTOR, audit=request.audit)
            records.append(ActionRecord(decision, dict(request.audit, by=_WEBHOOK_BY), []))
        decisions = [record.decision for record in records]
        if decisions:
            await publish(decisions)  # raises when the broker does not take them: Alertmanager retries
            if archive is not None:
                archive(records)  # the archive, or its spool while the archive is away
        for request in reading.requests:
            self.ledger.applied(request)
        for decision in decisions:
            logger.warning("alert rollback %s %s %s reason=%s from %s", decision.id, decision.action,
                           decision.key, decision.reason, decision.evidence.get("alertname"))
        reply = {"outcomes": dict(reading.outcomes), "decisions": [d.id for d in decisions]}
        if reading.refused:
            reply["refused"] = reading.refused[:_MAX_REFUSALS_REPLIED]
        return 200, reply


async def read_body(content: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes of a request body: ``read(n)`` of aiohttp's stream returns what is
    buffered so far, so one call can stop in the middle of a large body."""
    chunks, size = [], 0
    while size < limit:
        chunk = await content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
