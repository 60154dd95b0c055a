"""Operations against real servers: a Prometheus and an Alertmanager of the test's own around a live
`specwatch run` worker fed one seeded incident (dashboard queries, alerts both ways, rollback)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from functools import partial
from pathlib import Path

import pytest
from aiokafka.admin import NewTopic
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from specwatch.collectors.flag_client import FlagClient
from specwatch.transport.config import KafkaConfig
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline

from kafka_helpers import (INCIDENT_AT, MINUTES, PARTITIONS, SEED, TAIL_SECONDS, WORKERS, bad_records, create_topics,
                           delete_topics, published_decisions, run_async, send_raw, start_logged, stop_processes)
from machine import free_port, specwatch

pytestmark = pytest.mark.kafka

_REPO = Path(__file__).resolve().parents[1]
_DASHBOARD = _REPO / "deploy" / "grafana" / "specwatch.json"
_RULES = _REPO / "deploy" / "prometheus" / "specwatch-rules.yml"
_WAIT_S = 600.0  # a liveness bound for loaded 2-core machines, not a speed claim
_DRILL = "ExtractionTPOTDrill"
_TOKEN = "drill-token-" + uuid.uuid4().hex


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait_for(what: str, condition, logs, timeout: float = _WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{logs()}")


@pytest.fixture
def topics(kafka_bootstrap):
    """The run's telemetry, partials, decisions and dead-letter topics, deleted afterwards."""
    run = f"swops-{uuid.uuid4().hex[:8]}"
    names = [f"{run}.{t}" for t in ("telemetry", "partials", "decisions", "deadletter")]
    telemetry, partials, decisions, deadletter = names
    run_async(create_topics(kafka_bootstrap, NewTopic(telemetry, PARTITIONS, 1),
                            NewTopic(partials, PARTITIONS, 1), NewTopic(deadletter, PARTITIONS, 1),
                            NewTopic(decisions, 1, 1, topic_configs={"cleanup.policy": "compact"})))
    yield run, names
    run_async(delete_topics(kafka_bootstrap, run))


@pytest.fixture
def start(tmp_path):
    """Starts a named server with its log in ``tmp_path``; every one is stopped at the end."""
    processes: list[subprocess.Popen] = []
    yield lambda name, command: processes.append(start_logged(command, tmp_path / f"{name}.log"))
    stop_processes(processes)


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp.glob("*.log")))


def _panel_queries() -> list[str]:
    """Every PromQL expression of the dashboard (panels and annotations), variables set to "all"."""
    dashboard = json.loads(_DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets") or []]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    return [re.sub(r"\$(bundle|bucket)", ".*", e).replace("$__rate_interval", "15s") for e in exprs]


def _alerts(am_port: int) -> list[dict]:
    query = urllib.parse.urlencode({"filter": 'alertname="SpecwatchDecision"'})
    return _get_json(f"http://127.0.0.1:{am_port}/api/v2/alerts?{query}")


def test_prometheus_alertmanager_and_a_live_worker(kafka_bootstrap, topics, start, tmp_path):
    for binary in ("prometheus", "prometheus-alertmanager"):
        assert shutil.which(binary), f"{binary} is missing: deploy/prometheus/install.sh installs it"
    run, (telemetry, partials, decisions, deadletter) = topics
    bootstrap, tmp = kafka_bootstrap, tmp_path
    web, am, prom, drill_port = free_port(), free_port(), free_port(), free_port()
    token_file = tmp / "webhook.token"
    token_file.write_text(_TOKEN + "\n")
    (tmp / "rollback.toml").write_text(f'restore_on_resolve = ["{_DRILL}"]\n')

    # -- the drill switch: a target of the test's own that the drill rule reads ----------
    registry = CollectorRegistry()
    drill = Gauge("rollback_drill", "1 while the rollback drill is on", registry=registry)
    drill.set(1)
    drill_server, _ = start_http_server(drill_port, addr="127.0.0.1", registry=registry)
    logs = partial(_logs, tmp)

    # -- Alertmanager: the drill goes to specwatch's webhook, everything else nowhere ----
    (tmp / "alertmanager.yml").write_text(f"""
route:
  receiver: nowhere
  group_by: ['...']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
  routes:
    - matchers: ['alertname="{_DRILL}"']
      receiver: specwatch
receivers:
  - name: nowhere
  - name: specwatch
    webhook_configs:
      - url: http://127.0.0.1:{web}/alertmanager/webhook
        http_config:
          authorization:
            credentials_file: {token_file}
""")
    start("alertmanager", ["prometheus-alertmanager", f"--config.file={tmp / 'alertmanager.yml'}",
                                   f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am}",
                                   "--cluster.listen-address=", "--log.level=warn"])

    # -- the worker, with its web server and both Alertmanager directions ----------------
    start("worker", [sys.executable, "-m", "specwatch.cli", "run", "--bootstrap", bootstrap,
                             "--telemetry-topic", telemetry, "--partials-topic", partials,
                             "--decisions-topic", decisions, "--deadletter-topic", deadletter, "--app-id", run,
                             "--data-dir", str(tmp / "data"), "--archive", f"chdb://{tmp}/archive",
                             "--session-timeout", "6", "--source-silence", "5", "--checkpoint-seconds", "1",
                             "--web-port", str(web), "--web-bind", "127.0.0.1",
                             "--alertmanager-url", f"http://127.0.0.1:{am}",
                             "--webhook-token-file", str(token_file), "--rollback-policy", str(tmp / "rollback.toml"),
                             "--log-level", "info"])

    # -- Prometheus: scrapes the worker and the drill switch, evaluates every second -------
    (tmp / "drill-rules.yml").write_text(f"""
groups:
  - name: drill
    rules:
      - alert: {_DRILL}
        expr: max_over_time(specwatch_tpot_seconds{{bucket="extraction", cohort="main", quantile="0.99"}}[10m]) > 0
              and on() rollback_drill == 1
        labels:
          reason: latency_slo
""")
    (tmp / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{_RULES}", "{tmp / 'drill-rules.yml'}"]
alerting:
  alertmanagers:
    - static_configs: [{{targets: ["127.0.0.1:{am}"]}}]
scrape_configs:
  - job_name: specwatch
    static_configs: [{{targets: ["127.0.0.1:{web}"]}}]
  - job_name: drill
    static_configs: [{{targets: ["127.0.0.1:{drill_port}"]}}]
""")
    start("prometheus", ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom}",
                                 "--log.level=warn"])
    started = time.time()

    # -- the seeded incident, through Kafka; the embedded pipeline decides the same ------
    feed = specwatch("simulate", "--bootstrap", bootstrap, "--topic", telemetry, "--scenario", "acceptance_drop",
                     "--seed", str(SEED), "--workers", str(WORKERS), "--minutes", str(MINUTES), "--incident-at",
                     str(INCIDENT_AT), timeout=600)
    assert feed.returncode == 0, feed.stderr
    run_async(send_raw(bootstrap, telemetry, bad_records("healthy")))
    sim = Simulator("acceptance_drop", seed=SEED, workers=WORKERS, minutes=MINUTES, incident_at=INCIDENT_AT)
    embedded = EmbeddedPipeline()
    embedded.feed_many(sim.records())
    cutoff = sim.end_ts - TAIL_SECONDS
    expected = sorted((d.ts, d.key, d.action, d.reason) for d in embedded.decisions if d.ts < cutoff)
    assert expected, "the scenario decides nothing"
    bundle = embedded.decisions[0].bundle_id

    def automatic():
        return sorted((d.ts, d.key, d.action, d.reason) for d in published_decisions(bootstrap, decisions)
                      if d.detector != "alertmanager" and d.ts < cutoff)

    _wait_for("the worker publishes the scenario's decisions", lambda: automatic() == expected,
              logs)

    # -- alert-driven rollback: the drill rule fires, the webhook disables the scope ------
    def rollbacks(action):
        return [d for d in published_decisions(bootstrap, decisions) if d.detector == "alertmanager" and d.action == action]

    disabled = _wait_for("the drill alert reaches the webhook and its rollback the decisions topic",
                         lambda: rollbacks("disable_speculation"), logs)
    assert len(disabled) == 1, f"the same alert, sent again, decided again: {disabled}"
    rollback = disabled[0]
    assert (rollback.bundle_id, rollback.bucket, rollback.cohort, rollback.reason) == (
        bundle, "extraction", "main", "latency_slo")
    assert rollback.evidence["alertname"] == _DRILL and rollback.evidence["fingerprint"]
    assert rollback.evidence["generator_url"].startswith("http") and rollback.evidence["starts_at"]
    with FlagClient(KafkaConfig(bootstrap), topic=decisions, silence_seconds=None) as client:
        assert client.wait_until_caught_up(60)
        extraction = client.lookup(bundle, "extraction", "main")
        assert (extraction.enabled, extraction.reasons) == (False, ("latency_slo",))
        assert client.lookup(bundle, "extraction", "canary").enabled
        assert client.stats().forged == 0

    # -- decisions as alerts in Alertmanager ------------------------------------------------
    published = {d.id: d for d in published_decisions(bootstrap, decisions)}

    def decision_alerts():
        alerts = _alerts(am)
        keys = {(a["labels"]["bucket"], a["labels"]["cohort"], a["labels"]["action"], a["labels"]["reason"])
                for a in alerts}
        wanted = {(d.bucket or "*", d.cohort or "*", d.action, d.reason) for d in published.values()}
        return alerts if keys == wanted else None

    alerts = _wait_for("every decision is an alert in Alertmanager", decision_alerts, logs)
    for alert in alerts:
        decision = published[alert["annotations"]["decision_id"]]
        assert alert["labels"]["bundle"] == decision.bundle_id
        assert alert["annotations"]["explain"].startswith(f"specwatch explain {decision.id}")

    # -- every dashboard query returns series over the run ------------------------------
    def instant(expr: str) -> list:
        query = urllib.parse.urlencode({"query": expr})
        return _get_json(f"http://127.0.0.1:{prom}/api/v1/query?{query}")["data"]["result"]

    # the two bad records come last: wait until they are folded and scraped a few times
    _wait_for("Prometheus scrapes the rejected records", lambda: len(instant(
        "count_over_time(specwatch_records_rejected_total[1m]) >= 3")) == 2, logs)
    end = time.time()
    missing = []
    for expr in _panel_queries():
        query = urllib.parse.urlencode({"query": expr, "start": started, "end": end, "step": "1"})
        body = _get_json(f"http://127.0.0.1:{prom}/api/v1/query_range?{query}")
        assert body["status"] == "success", (expr, body)
        if not body["data"]["result"]:
            missing.append(expr)
    assert not missing, f"dashboard queries without series: {missing}\n{logs()}"

    # -- the drill ends: the rule resolves, the policy restores, the alert resolves -------
    drill.set(0)
    restored = _wait_for("the resolved drill restores the scope", lambda: rollbacks("restore"),
                         logs)
    assert len(restored) == 1 and restored[0].reason == "latency_slo"
    with FlagClient(KafkaConfig(bootstrap), topic=decisions, silence_seconds=None) as client:
        assert client.wait_until_caught_up(60)
        assert client.lookup(bundle, "extraction", "main").enabled
        assert not client.lookup(bundle, "coding", "main").enabled  # the scenario's own decision stands
    _wait_for("the rollback's alert is resolved in Alertmanager",
              lambda: not [a for a in _alerts(am) if a["labels"]["bucket"] == "extraction"], logs)
    remaining = {(a["labels"]["bucket"], a["labels"]["action"]) for a in _alerts(am)}
    assert ("coding", "disable_speculation") in remaining

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=10).read().decode()
    assert 'specwatch_webhook_alerts_total{outcome="applied"} 2.0' in metrics
    assert 'specwatch_records_rejected_total{reason="accepted_exceeds_drafted"} 1.0' in metrics
    assert 'specwatch_records_rejected_total{reason="invalid_otlp"} 1.0' in metrics
    assert f"specwatch_records_read_total {float(embedded.counters.records)}" in metrics
    drill_server.shutdown()
