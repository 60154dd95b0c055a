"""Operations without servers: the metrics view and its exposition, the Alertmanager sender and webhook,
the alert rules (promtool), the dashboard generator. The real servers are in test_operations_live.py."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwatch.actions.sinks.alertmanager import (AlertSender, RollbackPolicy, WebhookLedger, load_rollback_policy,
                                                  read_token_file, read_webhook)
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Decision
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.metrics import ServiceHealth
from specwatch.streams.operations import Operations, OperationsSettings

from machine import free_port, specwatch, specwatch_ok, until

_REPO = Path(__file__).resolve().parents[1]
_SEED = 11


def _samples(text: bytes) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture(scope="module")
def incident():
    """A seeded acceptance-drop incident through the embedded pipeline, with a metrics view fed per slice."""
    rows: list[dict] = []
    pipeline = EmbeddedPipeline()
    operations = Operations(OperationsSettings(web_port=None, max_metric_keys=10_000),
                            stages=lambda: [pipeline.stage2])
    pipeline.sinks = [operations.view.observe, lambda out: rows.extend(out.window_rows)]
    operations.health = lambda: ServiceHealth(records_read=pipeline.counters.records,
                                              records_rejected=pipeline.counters.rejected.as_dict())
    sim = Simulator("acceptance_drop", seed=_SEED, workers=3, minutes=2.5, incident_at=90.0)
    pipeline.feed_many(sim.records())
    pipeline.feed_line(b'{"kind":"step"')
    pipeline.finish()
    return operations, pipeline, rows


def test_metrics_are_the_newest_window_of_each_key(incident):
    operations, pipeline, rows = incident
    samples = _samples(operations.render())
    newest = {(row["bundle_id"], row["bucket"] or "*", row["cohort"] or "*"): row for row in rows}
    assert samples[("specwatch_metric_keys", ())] == len(newest)
    assert samples[("specwatch_metric_keys_overflow", ())] == 0
    checked = 0
    for (bundle, bucket, cohort), row in newest.items():
        labels = (("bucket", bucket), ("bundle", bundle), ("cohort", cohort))
        for metric, name in (("acceptance_length", "specwatch_acceptance_length"),
                             ("draft_overhead", "specwatch_draft_overhead_ratio"),
                             ("speedup", "specwatch_estimated_speedup_ratio"),
                             ("kv_peak", "specwatch_kv_usage_peak_ratio")):
            if math.isfinite(row[metric]):
                assert samples[(name, labels)] == row[metric]
                checked += 1
            else:
                assert (name, labels) not in samples
        if math.isfinite(row["e2e_p99"]):
            assert samples[("specwatch_e2e_seconds", tuple(sorted(labels + (("quantile", "0.99"),))))] == \
                row["e2e_p99"] / 1000.0
            checked += 1
        if row["drafted_tokens"]:
            assert samples[("specwatch_acceptance_rate_ratio", labels)] == row["accepted_tokens"] / row["drafted_tokens"]
    assert checked > 50


def test_flag_state_and_decision_counts(incident):
    operations, pipeline, _ = incident
    samples = _samples(operations.render())
    decided = Counter((d.action, d.reason) for d in pipeline.decisions)
    assert decided[("disable_speculation", "acceptance_drop")] == 1
    for (name, labels), value in samples.items():
        if name == "specwatch_decisions_total":
            label = dict(labels)
            assert value == decided.get((label["action"], label["reason"]), 0)
    # every contract (action, reason) pair is exported from zero: 6 actions x 10 reasons
    assert sum(1 for name, _ in samples if name == "specwatch_decisions_total") == 60
    enabled = {dict(labels)["bucket"] + "/" + dict(labels)["cohort"]: value
               for (name, labels), value in samples.items() if name == "specwatch_speculation_enabled"}
    off = [k for k, v in enabled.items() if v == 0]
    assert off == ["coding/main"]
    reasons = [dict(labels) for (name, labels), _ in samples.items() if name == "specwatch_speculation_off"]
    assert [(r["bucket"], r["cohort"], r["reason"]) for r in reasons] == [("coding", "main", "acceptance_drop")]
    # the disabled key drafts nothing, so no draft length; every other key drafts the card's D
    lengths = {dict(labels)["bucket"] + "/" + dict(labels)["cohort"]: value
               for (name, labels), value in samples.items() if name == "specwatch_draft_length_tokens"}
    assert set(lengths) == set(enabled) - {"coding/main"} and set(lengths.values()) == {4.0}
    assert samples[("specwatch_records_read_total", ())] == pipeline.counters.records
    assert samples[("specwatch_records_rejected_total", (("reason", "invalid_json"),))] == 1


def test_key_cap_bounds_cardinality_and_counts_the_rest(incident):
    _, pipeline, rows = incident
    capped = Operations(OperationsSettings(web_port=None, max_metric_keys=3), stages=lambda: [pipeline.stage2])
    every = sorted({(r["bundle_id"], r["bucket"] or "", r["cohort"] or "") for r in rows})
    samples = _samples(capped.render())
    exported = {(dict(labels)["bundle"], dict(labels)["bucket"].replace("*", ""), dict(labels)["cohort"].replace("*", ""))
                for (name, labels), _ in samples.items() if name == "specwatch_window_end_timestamp_seconds"}
    assert exported == set(every[:3])
    assert samples[("specwatch_metric_keys", ())] == 3
    assert samples[("specwatch_metric_keys_overflow", ())] == len(every) - 3


# ---------------------------------------------------------------- Alertmanager, outbound


def _decision(action: str, reason: str = "acceptance_drop", bucket: str | None = "coding", ts: float = 50.0):
    evidence = {"draft_length": 2} if action == "reduce_draft_length" else {}
    return Decision(ts=ts, bundle_id="b-1", bucket=bucket, cohort="main", action=action, reason=reason,
                    detector="acceptance_gate", evidence=evidence)


class _Recorder:
    def __init__(self, fail: int = 0) -> None:
        self.posts: list[list[dict]] = []
        self.fail = fail

    def __call__(self, url: str, body: bytes, timeout: float) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("refused")
        self.posts.append(json.loads(body))


def test_sender_fires_resends_and_resolves_on_restore():
    post, clock = _Recorder(), [1000.0]
    sender = AlertSender("http://am:9093", resend_seconds=30, post=post, clock=lambda: clock[0])
    reduce, disable = _decision("reduce_draft_length"), _decision("disable_speculation", ts=60.0)
    assert sender.submit(reduce) and sender.submit(disable) and sender.submit(_decision("alert", "draft_overhead"))
    assert sender.queued == 2  # an alert-only decision changes no path: nothing to page
    sender.send_now([reduce, disable])
    (fired,) = post.posts
    assert [a["labels"]["action"] for a in fired] == ["reduce_draft_length", "disable_speculation"]
    assert [a["labels"]["severity"] for a in fired] == ["ticket", "page"]
    assert fired[1]["annotations"]["decision_id"] == disable.id
    assert fired[1]["annotations"]["explain"] == f"specwatch explain {disable.id}"
    assert fired[1]["startsAt"] == "1970-01-01T00:01:00.000000Z"
    assert fired[1]["endsAt"] == "1970-01-01T00:18:40.000000Z"  # four resend intervals ahead
    clock[0] = 1030.0
    sender.resend()
    assert [a["endsAt"] for a in post.posts[1]] == ["1970-01-01T00:19:10.000000Z"] * 2
    clock[0] = 1040.0
    sender.send_now([_decision("restore", ts=70.0)])
    resolved = post.posts[2]
    assert sorted(a["labels"]["action"] for a in resolved) == ["disable_speculation", "reduce_draft_length"]
    assert {a["endsAt"] for a in resolved} == {"1970-01-01T00:17:20.000000Z"}
    sender.resend()
    assert len(post.posts) == 3  # nothing in force is left to re-send
    assert sender.counts == Counter(sent=6, resolved=2)


def test_sender_retries_counts_failures_and_drops_when_full():
    post = _Recorder(fail=2)
    sender = AlertSender("http://am:9093", retries=2, backoff_s=0.0, post=post, queue_size=1)
    sender.send_now([_decision("disable_speculation")])
    assert len(post.posts) == 1 and sender.counts["sent"] == 1  # third attempt took it
    post.fail = 3
    sender.send_now([_decision("disable_speculation", bucket="chat")])
    assert sender.counts["failed"] == 1 and len(post.posts) == 1
    assert sender.submit(_decision("disable_speculation")) and not sender.submit(_decision("disable_speculation"))
    assert sender.counts["dropped"] == 1


def test_sender_thread_delivers_and_never_blocks_the_caller():
    post = _Recorder()
    sender = AlertSender("http://am:9093", post=post).start()
    try:
        sender.submit(_decision("disable_speculation"))
        until(lambda: post.posts, 30)
    finally:
        sender.stop()
    assert post.posts and post.posts[0][0]["labels"]["reason"] == "acceptance_drop"


def test_sender_refuses_a_url_without_scheme():
    with pytest.raises(ValueError, match="http:// or https://"):
        AlertSender("alertmanager:9093")


# ---------------------------------------------------------------- Alertmanager, inbound

_CARDS = {"b-1": {"target": {"model_id": "llama-3-8b"}}, "b-2": {"target": {"model_id": "llama-3-8b"}},
          "b-3": {"target": {"model_id": "qwen"}}}


def _payload(*alerts: dict, status: str = "firing") -> dict:
    return {"version": "4", "status": status, "receiver": "specwatch", "groupKey": "{}", "alerts": list(alerts)}


def _alert(labels: dict, fingerprint: str = "f1", status: str = "firing") -> dict:
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": "2026-12-01T10:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom/graph?g0.expr=x", "fingerprint": fingerprint}


def test_webhook_reads_scopes_reasons_and_refusals():
    policy = RollbackPolicy(reasons={"VLLMHighTPOT": "latency_slo"})
    ledger = WebhookLedger()
    payload = _payload(
        _alert({"alertname": "VLLMHighTPOT", "model_name": "llama-3-8b", "bucket": "coding"}, "a"),
        _alert({"alertname": "Custom", "bundle": "b-3", "cohort": "canary", "reason": "error_rate"}, "b"),
        _alert({"alertname": "VLLMHighTPOT", "bundle": "b-9"}, "c"),
        _alert({"alertname": "Other", "bundle": "b-1"}, "d"),
        _alert({"alertname": "VLLMHighTPOT", "instance": "x"}, "e"),
        _alert({"alertname": "VLLMHighTPOT", "bundle": "b-1", "draft_length": "2"}, "f"))
    reading = read_webhook(payload, _CARDS, policy, ledger)
    requests, outcomes = reading.requests, reading.outcomes
    assert [(r.scope, r.reason, r.draft_limit) for r in requests] == [
        (("b-1", "coding", None), "latency_slo", None), (("b-2", "coding", None), "latency_slo", None),
        (("b-3", None, "canary"), "error_rate", None), (("b-1", None, None), "latency_slo", 2)]
    assert outcomes == Counter(applied=3, unknown_scope=1, no_reason=1, no_scope=1)
    assert requests[0].audit == {"alertname": "VLLMHighTPOT", "fingerprint": "a",
                                 "generator_url": "http://prom/graph?g0.expr=x",
                                 "starts_at": "2026-12-01T10:00:00Z", "status": "firing"}
    assert read_webhook(payload, _CARDS, policy, ledger).requests == requests  # nothing published: asked again
    for request in requests:
        ledger.applied(request)
    again = read_webhook(payload, _CARDS, policy, ledger)
    assert again.requests == [] and again.outcomes["duplicate"] == 3


def test_webhook_restores_only_where_the_policy_says():
    alert = {"alertname": "VLLMHighTPOT", "bundle": "b-1", "reason": "latency_slo"}
    resolved = _payload(_alert(alert, status="resolved"), status="resolved")
    reading = read_webhook(resolved, _CARDS, RollbackPolicy(), WebhookLedger())
    assert reading.requests == [] and reading.outcomes == Counter(not_restored=1)
    policy = RollbackPolicy(restore_on_resolve=frozenset({"VLLMHighTPOT"}))
    ledger = WebhookLedger()
    reading = read_webhook(resolved, _CARDS, policy, ledger)
    assert reading.requests == [] and reading.outcomes == Counter(not_held=1)  # it never turned b-1 off
    ledger.hold("f1", ("b-1", None, None))
    reading = read_webhook(resolved, _CARDS, policy, ledger)
    assert [(r.scope, r.restore) for r in reading.requests] == [(("b-1", None, None), True)]


@pytest.mark.parametrize("payload", [[], {"version": "3", "alerts": []}, {"version": "4"}])
def test_webhook_refuses_what_is_not_alertmanager_v4(payload):
    with pytest.raises(ValueError, match="version 4"):
        read_webhook(payload, _CARDS, RollbackPolicy(), WebhookLedger())


class _Published(list):
    """What a webhook published: one list of decisions a call."""

    async def __call__(self, decisions: list[Decision]) -> None:
        self.append(decisions)


def test_operations_webhook_authenticates_and_builds_signed_overrides():
    published = publish = _Published()
    settings = OperationsSettings(web_port=None, webhook_token="t0k",
                                  rollback=RollbackPolicy(restore_on_resolve=frozenset({"Drill"})))
    operations = Operations(settings, clock=lambda: 5000.0)
    body = json.dumps(_payload(_alert({"alertname": "Drill", "bundle": "b-1", "bucket": "coding",
                                       "reason": "latency_slo"}))).encode()

    def call(header, data=body):
        return asyncio.run(operations.webhook(header, data, _CARDS, publish, lambda scope: None))

    assert call(None)[0] == 401 and call("Bearer nope")[0] == 401
    assert call("Bearer t0k", b"not json")[0] == 400
    status, reply = call("Bearer t0k")
    assert status == 200 and reply["outcomes"] == {"applied": 1}
    (decision,) = published[0]
    assert (decision.action, decision.reason, decision.detector, decision.ts) == (
        "disable_speculation", "latency_slo", "alertmanager", 5000.0)
    assert (decision.bundle_id, decision.bucket, decision.cohort) == ("b-1", "coding", None)
    assert decision.evidence["by"] == "alertmanager" and decision.evidence["fingerprint"] == "f1"
    assert reply["decisions"] == [decision.id]
    assert call("Bearer t0k") == (200, {"outcomes": {"duplicate": 1}, "decisions": []})
    failing = Operations(settings, clock=lambda: 5000.0)

    async def broker_away(decisions):
        raise ConnectionError("broker away")

    status, reply = asyncio.run(failing.webhook("Bearer t0k", body, _CARDS, broker_away, lambda scope: None))
    assert status == 503 and "broker away" in reply["error"]
    status, reply = asyncio.run(failing.webhook("Bearer t0k", body, _CARDS, publish, lambda scope: None))
    assert status == 200 and reply["outcomes"] == {"applied": 1}  # the retry is not taken for a duplicate
    assert operations.webhook_requests == Counter({401: 2, 400: 1, 200: 2})
    off = Operations(OperationsSettings(web_port=None))
    assert asyncio.run(off.webhook("Bearer x", body, _CARDS, publish, lambda s: None))[0] == 403


def test_webhook_logs_each_rollback_once(caplog):
    published = publish = _Published()
    operations = Operations(OperationsSettings(web_port=None, webhook_token="t0k"), clock=lambda: 5000.0)
    body = json.dumps(_payload(*(_alert({"alertname": "Drill", "bundle": "b-1", "bucket": bucket,
                                         "reason": "latency_slo"}, bucket) for bucket in ("coding", "chat", "rag")))
                      ).encode()
    with caplog.at_level("WARNING", logger="specwatch.streams.operations"):
        status, reply = asyncio.run(operations.webhook("Bearer t0k", body, _CARDS, publish, lambda scope: None))
    assert status == 200 and len(reply["decisions"]) == len(published[0]) == 3
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("alert rollback")]
    assert sorted(line.split()[2] for line in logged) == sorted(reply["decisions"])


def test_rollback_policy_and_token_files_are_validated(tmp_path):
    bad = tmp_path / "bad.toml"
    for text, problem in (('[reasons]\nDrill = "slow"\n', "contract reason codes"),
                          ('restore = ["Drill"]\n', "unknown settings")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=problem):
            load_rollback_policy(bad)
    good = tmp_path / "good.toml"
    good.write_text('restore_on_resolve = ["Drill"]\n[reasons]\nDrill = "latency_slo"\n')
    policy = load_rollback_policy(good)
    assert policy.restores("Drill") and not policy.restores("Other") and policy.reasons == {"Drill": "latency_slo"}
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token_file(empty)


def test_run_refuses_a_bad_rollback_policy_in_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("nonsense = 1\n")
    done = specwatch("run", "--bootstrap", "127.0.0.1:1", "--rollback-policy", str(bad), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"specwatch run: rollback policy {bad}: unknown settings ['nonsense']; allowed: reasons, restore_on_resolve"]


# ---------------------------------------------------------------- demo --serve


def test_demo_serves_the_metrics_of_its_simulated_fleet(tmp_path):
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-m", "specwatch.cli", "demo", "--no-archive", "--minutes", "1",
                             "--outdir", str(tmp_path), "--serve", str(port), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in demo.stderr:
            if line.startswith("serving metrics on"):
                break
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        demo.terminate()
        out, _ = demo.communicate(timeout=60)
    summary = json.loads(out.strip().splitlines()[-1])
    samples = _samples(text)
    assert samples[("specwatch_records_read_total", ())] == summary["counters"]["records"]
    assert samples[("specwatch_metric_keys", ())] > 0


def test_demo_serve_on_a_busy_port_says_so(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        done = specwatch("demo", "--no-archive", "--serve", str(port), timeout=120)
    assert done.returncode == 2
    assert f"cannot serve metrics on port {port}" in done.stderr and "pick a free port" in done.stderr


# ---------------------------------------------------------------- rules and dashboard


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: deploy/prometheus/install.sh installs it"
    here = _REPO / "deploy" / "prometheus"
    check = subprocess.run([promtool, "check", "rules", "specwatch-rules.yml"], cwd=here, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 10 rules found" in check.stdout
    tests = subprocess.run([promtool, "test", "rules", "specwatch-rules.test.yml"], cwd=here, capture_output=True,
                           text=True, timeout=120)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_dashboard_regenerates_byte_for_byte():
    done = subprocess.run([sys.executable, str(_REPO / "deploy" / "grafana" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dashboard = json.loads((_REPO / "deploy" / "grafana" / "specwatch.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert {"Acceptance length (tokens per round)", "Draft overhead (share of step time)", "Estimated speedup",
            "e2e p50 / p99", "Speculation on (1) / off (0)", "Consumer lag (messages)"} <= set(titles)
    assert dashboard["annotations"]["list"][0]["expr"].startswith("changes(specwatch_decisions_total")


def test_bench_reports_stage2_with_and_without_the_metrics_view():
    done = specwatch_ok("bench", "--section", "metrics", "--smoke", "--json", timeout=600)
    metrics = json.loads(done.stdout.strip().splitlines()[-1])["metrics"]
    assert {"stage2_off_s", "stage2_on_s", "overhead_ratio", "observe_share_of_stage2", "scrape_ms",
            "scrape_core_share_at_15s"} <= set(metrics)
    assert (metrics["keys"], metrics["slices"]) == (50, 6)


def test_token_and_rollback_files_are_read_bounded_and_only_as_regular_files(tmp_path):
    big = tmp_path / "token"
    big.write_bytes(b"t" * 5000)
    for path, problem in ((big, "larger than 4096 bytes"), ("/dev/zero", "a character device")):
        with pytest.raises(ValueError, match=f"cannot read the webhook token file {path}: .*{problem}"):
            read_token_file(path)
    with pytest.raises(ValueError, match="cannot read the rollback policy /dev/zero: .*a character device"):
        load_rollback_policy("/dev/zero")
    good = tmp_path / "good"
    good.write_text("  s3cret-token\n")
    assert read_token_file(good) == "s3cret-token"


def test_alert_explain_hints_name_the_archive_without_its_password(monkeypatch):
    from specwatch import cli
    from specwatch.streams import operations

    seen = {}

    def capture(**settings):
        seen.update(settings)
        raise ValueError("stopped after the operations settings")

    monkeypatch.setattr(operations, "OperationsSettings", capture)
    code = cli.main(["run", "--bootstrap", "127.0.0.1:1", "--archive", "https://ops:hunter2@ch.internal/postmortems"])
    assert code == 2
    assert seen["explain_archive"] == "https://ch.internal:8443/postmortems"
