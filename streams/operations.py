"""A worker's operations surface: /metrics, /healthz, /readyz and the Alertmanager webhook."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specwatch.actions.sinks.alertmanager import (
    WEBHOOK_OUTCOMES,
    AlertSender,
    RollbackPolicy,
    WebhookLedger,
    bearer_token_ok,
    read_webhook,
)
from specwatch.actions.flags import OverrideChange, override_decision
from specwatch.schemas import Decision

from .metrics import MetricsCollector, MetricsView, ServiceHealth

__all__ = ["OperationsSettings", "Operations", "WEBHOOK_PATH"]

logger = logging.getLogger(__name__)

WEBHOOK_PATH = "/alertmanager/webhook"
_WEBHOOK_BY = "alertmanager"
_MAX_WEBHOOK_BYTES = 4 << 20


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
                publish: Callable[[list[Decision]], Any], automatic: Callable[[tuple], Any]) -> None:
        """Add /metrics, /healthz, /readyz and the webhook to ``app`` (a `faust.App`)."""
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
                status, body = await operations.webhook(request.headers.get("Authorization"),
                                                        await request.content.read(_MAX_WEBHOOK_BYTES + 1),
                                                        cards(), publish, automatic)
                return self.json(body, status=status)

        for path, view in (("/metrics", MetricsPage), ("/healthz", HealthPage), ("/readyz", ReadyPage),
                           (WEBHOOK_PATH, WebhookPage)):
            view.view_name = path.strip("/").replace("/", "_")
            view.view_path = path
            app.web.add_view(view)

    async def webhook(self, authorization: str | None, body: bytes, cards: dict,
                      publish: Callable[[list[Decision]], Any], automatic: Callable[[tuple], Any]) -> tuple[int, dict]:
        """Handle one webhook request; returns (HTTP status, JSON body)."""
        try:
            status, reply = await self._webhook(authorization, body, cards, publish, automatic)
        except Exception as error:  # noqa: BLE001 - the broker did not take the decisions; Alertmanager retries 5xx
            logger.error("alert rollback not published: %s", error)
            status, reply = 503, {"error": f"the decisions topic did not take the rollback: {error}"}
        self.webhook_requests[status] += 1
        return status, reply

    async def _webhook(self, authorization, body, cards, publish, automatic) -> tuple[int, dict]:
        token = self.settings.webhook_token
        if token is None:
            return 403, {"error": "the webhook is off: start the worker with --webhook-token-file"}
        if not bearer_token_ok(authorization, token):
            return 401, {"error": "missing or wrong bearer token (Alertmanager http_config.authorization)"}
        if len(body) > _MAX_WEBHOOK_BYTES:
            return 413, {"error": f"payload over {_MAX_WEBHOOK_BYTES} bytes"}
        try:
            requests, outcomes = read_webhook(json.loads(body), cards, self.settings.rollback, self.ledger)
        except ValueError as error:
            return 400, {"error": str(error)}
        self.webhook_alerts.update(outcomes)
        now = self.clock()
        decisions = []
        for request in requests:
            bundle, bucket, cohort = request.scope
            note = f"alert {request.audit['alertname']} {request.audit['status']}"
            change = OverrideChange(bundle, bucket, cohort, enabled=request.draft_limit is not None,
                                    draft_limit=request.draft_limit, by=_WEBHOOK_BY, reason=note, ts=now,
                                    cleared=request.restore)
            decisions.append(override_decision(change, request.reason,
                                               automatic(request.scope) if request.restore else None,
                                               detector="alertmanager", audit=request.audit))
        if decisions:
            await publish(decisions)  # raises when the broker does not take them: Alertmanager retries
        for request in requests:
            self.ledger.record(request.ident)
        for decision in decisions:
            logger.warning("alert rollback %s %s %s reason=%s from %s", decision.id, decision.action,
                           decision.key, decision.reason, decision.evidence.get("alertname"))
        return 200, {"outcomes": dict(outcomes), "decisions": [d.id for d in decisions]}

