"""The webhook of a live `specwatch run` worker on the real broker, with a real chDB archive: one alert
posted 100 times at once is one signed decision on the decisions topic, still one after the worker
restarts and Alertmanager sends it again, and the archive holds it with its audit row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specwatch.archive.store import Archive
from specwatch.collectors.flag_client import FlagClient
from specwatch.lab.simulation.simulator import Simulator
from specwatch.transport.config import KafkaConfig

from kafka_helpers import SEED, published_decisions, stop_processes
from machine import free_port, specwatch
from test_operations_live import _wait_for, topics  # noqa: F401 - topics: the run's topics, deleted afterwards

pytestmark = pytest.mark.kafka

_TOKEN = "webhook-live-" + uuid.uuid4().hex
_KEY = "webhook live test signing key " + uuid.uuid4().hex


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Authorization": f"Bearer {_TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _log(path: Path):
    return lambda: path.read_text()[-4000:]


def test_one_alert_at_once_and_again_after_a_restart_is_one_signed_archived_decision(kafka_bootstrap, topics,
                                                                                      tmp_path):
    run, (telemetry, partials, decisions, deadletter) = topics
    web = free_port()
    token_file = tmp_path / "webhook.token"
    token_file.write_text(_TOKEN + "\n")
    archive = tmp_path / "archive"
    environ = {"SPECWATCH_SIGNING_KEY": _KEY, "SPECWATCH_ARCHIVE_SPOOL": str(tmp_path / "spool")}
    worker = [sys.executable, "-m", "specwatch.cli", "run", "--bootstrap", kafka_bootstrap,
              "--telemetry-topic", telemetry, "--partials-topic", partials, "--decisions-topic", decisions,
              "--deadletter-topic", deadletter, "--app-id", run, "--data-dir", str(tmp_path / "data"),
              "--archive", f"chdb://{archive}", "--session-timeout", "6", "--source-silence", "5",
              "--checkpoint-seconds", "1", "--web-port", str(web), "--web-bind", "127.0.0.1",
              "--webhook-token-file", str(token_file), "--log-level", "info"]
    url = f"http://127.0.0.1:{web}/alertmanager/webhook"
    bundle = next(r.bundle_id for r in Simulator("demo", seed=SEED, workers=2, minutes=0.5).records()
                  if getattr(r, "bundle_id", None))
    body = json.dumps({"version": "4", "status": "firing", "receiver": "specwatch", "groupKey": "{}", "alerts": [{
        "status": "firing", "labels": {"alertname": "Drill", "bundle": bundle, "bucket": "coding",
                                       "reason": "latency_slo"},
        "annotations": {}, "startsAt": "2026-12-01T10:00:00.5Z", "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph", "fingerprint": "5eed5eed5eed5eed"}]}).encode()

    def rollbacks():
        return [d for d in published_decisions(kafka_bootstrap, decisions) if d.detector == "alertmanager"]

    env = dict(os.environ, **environ)
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(worker, env=env, stdout=open(tmp_path / "worker-1.log", "w"),
                                          stderr=subprocess.STDOUT))
        feed = specwatch("simulate", "--bootstrap", kafka_bootstrap, "--topic", telemetry, "--scenario", "demo",
                         "--seed", str(SEED), "--workers", "2", "--minutes", "0.5", timeout=600)
        assert feed.returncode == 0, feed.stderr
        # the worker knows the bundle once the alert is no longer an unknown scope; nothing is decided till then
        probe = json.dumps({"version": "4", "alerts": [{"labels": {"bundle": bundle, "alertname": "Probe"},
                                                         "status": "firing", "fingerprint": "0",
                                                         "startsAt": "2026-12-01T10:00:00Z"}]}).encode()
        _wait_for("the worker knows the bundle", lambda: _post(url, probe)[1].get("outcomes") == {"no_reason": 1},
                  _log(tmp_path / "worker-1.log"))

        with ThreadPoolExecutor(max_workers=100) as pool:
            replies = list(pool.map(lambda _: _post(url, body), range(100)))
        assert [status for status, _ in replies] == [200] * 100
        assert sorted(json.dumps(reply["outcomes"]) for _, reply in replies) == sorted(
            ['{"applied": 1}'] + ['{"duplicate": 1}'] * 99)
        (rollback,) = rollbacks()
        assert (rollback.key, rollback.action, rollback.reason, rollback.evidence["fingerprint"]) == (
            f"{bundle}/coding/*", "disable_speculation", "latency_slo", "5eed5eed5eed5eed")

        stop_processes(processes)  # a restart: the ledger comes back from the archive
        processes.append(subprocess.Popen(worker, env=env, stdout=open(tmp_path / "worker-2.log", "w"),
                                          stderr=subprocess.STDOUT))
        _wait_for("the restarted worker knows the bundle again",
                  lambda: _post(url, probe)[1].get("outcomes") == {"no_reason": 1}, _log(tmp_path / "worker-2.log"))
        assert _post(url, body) == (200, {"outcomes": {"duplicate": 1}, "decisions": []})
        assert [d.id for d in rollbacks()] == [rollback.id]
        with FlagClient(KafkaConfig(kafka_bootstrap), topic=decisions, silence_seconds=None) as client:
            assert client.wait_until_caught_up(60)
            assert not client.lookup(bundle, "coding", "main").enabled
            stats = client.stats()
            assert (stats.forged, stats.unsigned) == (0, 0)  # signed, as every flag client wants it
    finally:
        stop_processes(processes)
    with Archive.open(f"chdb://{archive}", create=False) as archived:
        (row,) = [r for r in archived.decisions(limit=None) if r["detector"] == "alertmanager"]
        assert row["decision_id"] == rollback.id
        audit = archived.decision(rollback.id)["audit"]
        assert (audit["detail"]["fingerprint"], audit["detail"]["alertname"]) == ("5eed5eed5eed5eed", "Drill")
