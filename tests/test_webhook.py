"""The Alertmanager webhook on a worker's own web server (Faust's, aiohttp): whole bodies up to the
limit, 413 and 400 where Alertmanager must not retry, one decision per alert under concurrency and
across a restart, labels held to the contract, restores keyed by the alert that turned a scope off,
and every applied rollback in a real chDB archive with its audit row."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter

import aiohttp
import faust
import pytest

from specwatch.actions.sinks.alertmanager import RollbackPolicy
from specwatch.archive.sink import ArchiveSink
from specwatch.archive.store import Archive
from specwatch.schemas import Decision
from specwatch.streams.operations import WEBHOOK_PATH, Operations, OperationsSettings
from specwatch.transport.codec import DecisionSink, decode_decision
from specwatch.transport.signing import Keyring, Verdict, verify

from machine import free_port

_TOKEN = "t0k-webhook"
_AUTH = {"Authorization": f"Bearer {_TOKEN}", "Content-Type": "application/json"}
_KEYRING = Keyring.from_secrets("webhook test signing key, 32 bytes")
_CARDS = {f"b-{i}": {"target": {"model_id": "llama"}} for i in range(1, 4)}
_LIMIT = 4 << 20
_CHUNK = 16 << 10


def _alert(fingerprint: str, status: str = "firing", **labels: str) -> dict:
    labels = {"alertname": "Drill", "bundle": "b-1", "reason": "latency_slo", **labels}
    return {"status": status, "labels": labels, "annotations": {"summary": "p99 over the SLO"},
            "startsAt": "2026-12-01T10:00:00.123456789Z", "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph?g0.expr=x", "fingerprint": fingerprint}


def _payload(*alerts: dict, status: str = "firing") -> dict:
    return {"version": "4", "status": status, "receiver": "specwatch", "groupKey": "{}:{}", "truncatedAlerts": 0,
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093",
            "alerts": list(alerts)}


def _sized(target_bytes: int, padding: int = 400) -> tuple[bytes, int]:
    """A valid payload of about ``target_bytes``: alerts with long annotations, all for bundle b-1's
    buckets (as a big Alertmanager group is); returns the body and how many alerts it holds."""
    alerts, size = [], 200
    while size < target_bytes:
        alert = _alert(f"{len(alerts):016x}", bucket=f"bucket-{len(alerts)}")
        alert["annotations"]["description"] = "x" * padding
        alerts.append(alert)
        size += len(json.dumps(alert)) + 2
    return json.dumps(_payload(*alerts)).encode(), len(alerts)


class _Topic:
    """The decisions topic as a flag client reads it: every decision signed, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes, list]] = []
        self._sink = DecisionSink(lambda topic, value, key, headers: self.messages.append((key, value, headers)),
                                  "decisions", _KEYRING)

    async def __call__(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            self._sink.decision(decision)
            await asyncio.sleep(0)  # a broker round trip: other requests run meanwhile

    def decisions(self) -> list[Decision]:
        assert all(verify(value, headers, _KEYRING) is Verdict.VALID for _, value, headers in self.messages)
        return [decode_decision(value) for _, value, _ in self.messages]


class _Worker:
    """Operations with the webhook on, on Faust's web server at ``url``; rollbacks go to ``topic``
    and, with an archive, to it through an `ArchiveSink`."""

    def __init__(self, topic: _Topic, sink: ArchiveSink | None = None, policy: RollbackPolicy | None = None,
                 automatic=lambda scope: None) -> None:
        self.topic, self.sink = topic, sink
        self.operations = Operations(OperationsSettings(web_port=None, webhook_token=_TOKEN,
                                                        rollback=policy or RollbackPolicy()), clock=lambda: 5000.0)
        port = free_port()
        self.app = faust.App(f"webhook-test-{port}", broker="kafka://127.0.0.1:1", web_port=port,
                             web_bind="127.0.0.1", web_enabled=True, autodiscover=False)
        archive = {"archive": sink.write_actions} if sink is not None else {}
        self.operations.install(self.app, ready=lambda: True, cards=lambda: _CARDS, publish=topic,
                                automatic=automatic, **archive)
        self.port = port
        self.url = f"http://127.0.0.1:{port}{WEBHOOK_PATH}"

    async def __aenter__(self) -> "_Worker":
        await self.app.web.start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.app.web.stop()

    async def post(self, body: bytes | dict, *, pieces: bool = False, length: bool = True) -> tuple[int, dict]:
        """POST ``body``; with ``pieces`` it goes out as a slow network delivers it, 16 KiB at a time
        with the server let run in between (so its handler starts before the last byte is in), and
        without ``length`` in chunked transfer encoding."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if not pieces:
            async with self.http.post(self.url, data=data, headers=_AUTH) as response:
                return response.status, await response.json(content_type=None)
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        framing = f"Content-Length: {len(data)}" if length else "Transfer-Encoding: chunked"
        writer.write(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Authorization: {_AUTH['Authorization']}\r\nContent-Type: application/json\r\n"
                     f"{framing}\r\n\r\n".encode())
        for start in range(0, len(data), _CHUNK):
            piece = data[start:start + _CHUNK]
            writer.write(piece if length else b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0)
        if not length:
            writer.write(b"0\r\n\r\n")
        with contextlib.suppress(ConnectionError):  # a refusal may close before the last piece
            await writer.drain()
        head, _, rest = (await reader.read()).partition(b"\r\n\r\n")
        writer.close()
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            rest = rest.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
        return status, json.loads(rest)


def _run(scenario):
    return asyncio.run(scenario())


@contextlib.contextmanager
def _archive(tmp_path, name: str = "archive"):
    with Archive.open(f"chdb://{tmp_path / name}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / f"{name}-spool")
        yield archive, sink
        sink.close()


# ---------------------------------------------------------------- the body

@pytest.mark.parametrize("size, padding", [(167_000, 400), (390_000, 190), (4_100_000, 400)])
def test_valid_payloads_up_to_the_limit_are_read_whole_every_time(size, padding):
    body, alerts = _sized(size, padding)
    assert size <= len(body) <= _LIMIT

    async def scenario():
        async with _Worker(_Topic()) as worker:
            replies = [await worker.post(body, pieces=True) for _ in range(3)]
            replies.append(await worker.post(body))  # and in one piece, with its length
            return replies, worker.topic.decisions()

    replies, decisions = _run(scenario)
    assert [status for status, _ in replies] == [200] * 4
    assert replies[0][1]["outcomes"] == {"applied": alerts}
    assert all(reply["outcomes"] == {"duplicate": alerts} for _, reply in replies[1:])
    assert sorted(d.bucket for d in decisions) == sorted(f"bucket-{i}" for i in range(alerts))
    if size == 390_000:
        assert alerts >= 700


def test_over_the_limit_is_413_and_nothing_past_it_is_read():
    body, _ = _sized(_LIMIT + 10_000)

    async def scenario():
        async with _Worker(_Topic()) as worker:
            declared = await worker.post(body, pieces=True)  # Content-Length says it: refused unread
            streamed = await worker.post(body, pieces=True, length=False)  # read to the limit + 1, refused
            return declared, streamed, worker.topic.messages, worker.operations.webhook_requests

    declared, streamed, messages, requests = _run(scenario)
    assert declared == streamed == (413, {"error": f"payload over {_LIMIT} bytes"})
    assert messages == [] and requests == Counter({413: 2})


def test_a_body_over_the_limit_without_the_token_is_401_unread():
    operations = Operations(OperationsSettings(web_port=None, webhook_token=_TOKEN))
    assert operations.refuse_oversize("Bearer wrong")[0] == 401
    assert operations.refuse_oversize(None)[0] == 401
    assert Operations(OperationsSettings(web_port=None)).refuse_oversize(f"Bearer {_TOKEN}")[0] == 403


@pytest.mark.parametrize("body, error", [
    (b"[" * 50_000 + b"]" * 50_000, "JSON nested too deep"),
    (b'{"version": "4", "alerts": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}", "JSON nested too deep"),
    (b'{"version": "4", "alerts": [}', "Expecting"),
    (b"\xff\xfe not utf-8", "Expecting value"),
    (json.dumps({"version": "3", "alerts": []}).encode(), "version 4"),
])
def test_a_body_that_never_parses_is_400_so_alertmanager_does_not_retry_it(body, error):
    async def scenario():
        async with _Worker(_Topic()) as worker:
            return await worker.post(body), worker.topic.messages

    (status, reply), messages = _run(scenario)
    assert status == 400 and error in reply["error"] and messages == []


# ---------------------------------------------------------------- once

def test_one_alert_posted_100_times_at_once_is_one_signed_decision():
    body = _payload(_alert("a1b2c3d4e5f60718", bucket="coding"))

    async def scenario():
        async with _Worker(_Topic()) as worker:
            replies = await asyncio.gather(*(worker.post(body) for _ in range(100)))
            return replies, worker.topic.decisions()

    replies, decisions = _run(scenario)
    assert Counter(status for status, _ in replies) == Counter({200: 100})
    assert Counter(json.dumps(reply["outcomes"]) for _, reply in replies) == Counter(
        {'{"applied": 1}': 1, '{"duplicate": 1}': 99})
    (decision,) = decisions
    assert (decision.key, decision.action, decision.reason, decision.detector) == (
        "b-1/coding/*", "disable_speculation", "latency_slo", "alertmanager")


def test_one_alert_posted_100_times_at_once_is_one_archive_row_with_its_audit(tmp_path):
    body = _payload(_alert("a1b2c3d4e5f60718", bucket="coding"))

    async def scenario(sink):
        async with _Worker(_Topic(), sink) as worker:
            await asyncio.gather(*(worker.post(body) for _ in range(100)))
            return worker.topic.decisions()

    with _archive(tmp_path) as (archive, sink):
        (decision,) = _run(lambda: scenario(sink))
        (row,) = archive.decisions(limit=None)
        assert row["decision_id"] == decision.id
        audit = archive.decision(decision.id)["audit"]
        assert (audit["kind"], audit["detector"], audit["detail"]["fingerprint"], audit["detail"]["by"]) == (
            "decision", "alertmanager", "a1b2c3d4e5f60718", "alertmanager")


def test_after_a_restart_the_archive_keeps_a_resent_alert_a_duplicate(tmp_path):
    body = _payload(_alert("00000000000000aa", bucket="coding"), _alert("00000000000000bb", bucket="chat"))
    policy = RollbackPolicy(restore_on_resolve=frozenset({"Drill"}))

    async def first(sink):
        async with _Worker(_Topic(), sink, policy) as worker:
            return await worker.post(body)

    async def restarted(sink):
        worker = _Worker(_Topic(), sink, policy)
        taken = worker.operations.remember(sink.decisions_by("alertmanager"))
        async with worker:
            again = await worker.post(body)
            resolved = await worker.post(_payload(_alert("00000000000000aa", "resolved", bucket="coding"),
                                                  status="resolved"))
            return taken, again, resolved, worker.topic.decisions()

    with _archive(tmp_path) as (archive, sink):
        assert _run(lambda: first(sink))[1]["outcomes"] == {"applied": 2}
        taken, again, resolved, decisions = _run(lambda: restarted(sink))
        assert taken == 2
        assert again == (200, {"outcomes": {"duplicate": 2}, "decisions": []})
        # the archive also says which alert turned each scope off: the resolved one restores its own
        assert resolved[1]["outcomes"] == {"applied": 1}
        (restore,) = decisions
        assert (restore.key, restore.action) == ("b-1/coding/*", "restore")
        assert [r["action"] for r in archive.decisions(limit=None)] == [
            "disable_speculation", "disable_speculation", "restore"]


def test_every_applied_rollback_is_archived_with_its_audit_row(tmp_path):
    alerts = [_alert(f"{i:016x}", bucket=f"bucket-{i}") for i in range(19)]

    async def scenario(sink):
        async with _Worker(_Topic(), sink) as worker:
            replies = await asyncio.gather(*(worker.post(_payload(alert)) for alert in alerts))
            return replies, worker.topic.decisions()

    with _archive(tmp_path) as (archive, sink):
        replies, decisions = _run(lambda: scenario(sink))
        assert all(reply["outcomes"] == {"applied": 1} for _, reply in replies)
        rows = archive.decisions(limit=None)
        assert sorted(r["decision_id"] for r in rows) == sorted(d.id for d in decisions) and len(rows) == 19
        audits = archive.audit(kind="decision")
        assert sorted(a["decision_id"] for a in audits) == sorted(d.id for d in decisions)
        assert {a["detail"]["alertname"] for a in audits} == {"Drill"}


# ---------------------------------------------------------------- labels

@pytest.mark.parametrize("labels, field, reason", [
    ({"bucket": "coding\x1b[2J\x1b[31m"}, None, "label bucket: 'coding\\x1b[2J\\x1b[31m' is not a name the contract takes"),
    ({"bucket": "coding\nforged log line"}, None, "label bucket: 'coding\\nforged log line' is not a name"),
    ({"bucket": "b" * 100_000}, None, "label bucket: '" + "b" * 64 + "' is not a name the contract takes"),
    ({"bucket": "a/b"}, None, "label bucket: 'a/b' is not a name the contract takes"),
    ({"bundle": "b-1\u202e"}, None, "label bundle: 'b-1\\u202e' is not a name the contract takes"),
    ({"draft_length": "99999"}, None, "label draft_length: '99999' is not a draft length (1 to 64)"),
    ({"draft_length": "-1"}, None, "label draft_length: '-1' is not a draft length (1 to 64)"),
    ({"draft_length": "0"}, None, "label draft_length: '0' is not a draft length (1 to 64)"),
    ({"draft_length": "\u0664"}, None, "label draft_length: '\u0664' is not a draft length (1 to 64)"),
    ({}, ("startsAt", "not-a-time"), "startsAt: 'not-a-time' is not an RFC 3339 time with a zone"),
    ({}, ("startsAt", "2026-12-01T10:00:00"), "startsAt: '2026-12-01T10:00:00' is not an RFC 3339 time with a zone"),
    ({}, ("fingerprint", 7), "fingerprint: '7' is not a name the contract takes"),
])
def test_labels_the_contract_refuses_refuse_that_alert_alone(labels, field, reason):
    bad = _alert("00000000000000bd", **labels)
    if field is not None:
        bad[field[0]] = field[1]
    good = _alert("000000000000000d", bucket="coding", draft_length="2")

    async def scenario():
        async with _Worker(_Topic()) as worker:
            reply = await worker.post(_payload(bad, good))
            return reply, worker.topic.decisions(), worker.operations.webhook_alerts

    (status, reply), decisions, counted = _run(scenario)
    assert status == 200 and reply["outcomes"] == {"invalid_alert": 1, "applied": 1}
    (refusal,) = reply["refused"]
    assert refusal["alertname"] == "Drill" and refusal["reason"].startswith(reason)
    (decision,) = decisions  # the good alert of the same payload still applies
    assert (decision.key, decision.action, decision.evidence["draft_length"]) == (
        "b-1/coding/*", "reduce_draft_length", 2)
    assert counted["invalid_alert"] == 1 and counted["applied"] == 1


# ---------------------------------------------------------------- restore

def test_a_resolved_alert_restores_only_what_it_turned_off():
    policy = RollbackPolicy(restore_on_resolve=frozenset({"Drill", "Other"}))
    coding = {"bucket": "coding"}

    async def scenario():
        async with _Worker(_Topic(), policy=policy) as worker:
            post = worker.post
            steps = [
                # never fired here: restores nothing, though "Other" turned the scope off
                await post(_payload(_alert("000000000000000f", alertname="Other", **coding))),
                await post(_payload(_alert("00000000000000aa", "resolved", **coding), status="resolved")),
                # both hold it: the first to resolve lets go, the scope stays off
                await post(_payload(_alert("00000000000000aa", **coding))),
                await post(_payload(_alert("00000000000000aa", "resolved", **coding), status="resolved")),
                # the last holder resolves: now it is restored
                await post(_payload(_alert("000000000000000f", "resolved", alertname="Other", **coding),
                                    status="resolved")),
            ]
            return [reply["outcomes"] for _, reply in steps], worker.topic.decisions()

    outcomes, decisions = _run(scenario)
    assert outcomes == [{"applied": 1}, {"not_held": 1}, {"applied": 1}, {"still_held": 1}, {"applied": 1}]
    assert [(d.action, d.key, d.evidence["fingerprint"], d.evidence["status"]) for d in decisions] == [
        ("disable_speculation", "b-1/coding/*", "000000000000000f", "firing"),
        ("disable_speculation", "b-1/coding/*", "00000000000000aa", "firing"),
        # letting go while another holds on changes no path; it is a record of it
        ("alert", "b-1/coding/*", "00000000000000aa", "resolved"),
        ("restore", "b-1/coding/*", "000000000000000f", "resolved")]
    assert decisions[2].evidence["held_by"] == ["000000000000000f"]


@pytest.mark.parametrize("resent", [False, True], ids=["last-holder-resolves", "resolved-alert-resent-first"])
def test_a_restart_between_two_resolves_keeps_who_let_go(tmp_path, resent):
    """Two alerts hold one scope off; the first resolves, the worker restarts, then the second
    resolves: the scope is restored, once. Alertmanager sending the first resolution again after
    the restart is a duplicate, not a second letting go."""
    policy = RollbackPolicy(restore_on_resolve=frozenset({"Drill"}))
    coding = {"bucket": "coding"}
    first_alert, second_alert = _alert("00000000000000aa", **coding), _alert("00000000000000bb", **coding)
    first_resolved = _payload(_alert("00000000000000aa", "resolved", **coding), status="resolved")

    async def before(sink):
        async with _Worker(_Topic(), sink, policy) as worker:
            replies = [await worker.post(_payload(first_alert)), await worker.post(_payload(second_alert)),
                       await worker.post(first_resolved)]
            return [reply["outcomes"] for _, reply in replies]

    async def after(sink):
        worker = _Worker(_Topic(), sink, policy)
        taken = worker.operations.remember(sink.decisions_by("alertmanager"))
        async with worker:
            posts = [first_resolved] if resent else []
            posts.append(_payload(_alert("00000000000000bb", "resolved", **coding), status="resolved"))
            replies = [await worker.post(body) for body in posts]
            return taken, [reply["outcomes"] for _, reply in replies], worker.topic.decisions()

    with _archive(tmp_path) as (archive, sink):
        assert _run(lambda: before(sink)) == [{"applied": 1}, {"applied": 1}, {"still_held": 1}]
        taken, outcomes, decisions = _run(lambda: after(sink))
        assert taken == 3
        assert outcomes == ([{"duplicate": 1}] if resent else []) + [{"applied": 1}]
        (restore,) = decisions
        assert (restore.action, restore.key, restore.reason, restore.evidence["fingerprint"]) == (
            "restore", "b-1/coding/*", "latency_slo", "00000000000000bb")
        assert [(r["action"], r["bucket"]) for r in archive.decisions(limit=None)] == [
            ("disable_speculation", "coding"), ("disable_speculation", "coding"), ("alert", "coding"),
            ("restore", "coding")]


def test_a_restore_keeps_what_the_detectors_turned_off():
    from specwatch.actions.flags import ScopeState

    policy = RollbackPolicy(restore_on_resolve=frozenset({"Drill"}))
    detectors_say = ScopeState(enabled=False, reason="acceptance_drop", decision_id="d-auto", ts=10.0)

    async def scenario():
        async with _Worker(_Topic(), policy=policy, automatic=lambda scope: detectors_say) as worker:
            await worker.post(_payload(_alert("00000000000000aa", bucket="coding")))
            await worker.post(_payload(_alert("00000000000000aa", "resolved", bucket="coding"), status="resolved"))
            return worker.topic.decisions()

    fired, resolved = _run(scenario)
    assert (fired.action, resolved.action, resolved.evidence["cleared"]) == (
        "disable_speculation", "disable_speculation", True)
