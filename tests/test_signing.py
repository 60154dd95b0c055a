"""Signed decisions: the HMAC header, key rotation, and a flag client that acts only on signed messages.
The Kafka tests publish first, then start the client: once caught up, the counters are exact."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer

from specwatch import cli
from specwatch.actions.sinks.publisher import DecisionPublisher
from specwatch.collectors.flag_client import FlagClient
from specwatch.transport.codec import heartbeat_message
from specwatch.transport.signing import SIGNATURE_HEADER, Keyring, Verdict, sign_line, verify
from specwatch.transport.config import KafkaConfig
from specwatch.schemas import Decision

_API_VERSION = (4, 0)
_KEY = b"k" * 16 + os.urandom(16)
_OLD_KEY = b"o" * 16 + os.urandom(16)
_OTHER_KEY = b"x" * 16 + os.urandom(16)


def _without_key(monkeypatch) -> None:
    for name in ("SPECWATCH_SIGNING_KEY", "SPECWATCH_SIGNING_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)


def _with_key(monkeypatch, secret) -> Keyring:
    """``secret`` as the environment's signing key; returns its keyring."""
    monkeypatch.delenv("SPECWATCH_SIGNING_KEY_FILE", raising=False)
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", secret)
    return Keyring.from_secrets(secret)


@contextlib.contextmanager
def _caught_up(bootstrap: str, topic: str, keyring: Keyring):
    """A flag client that has read ``topic`` to its end."""
    with FlagClient(KafkaConfig(bootstrap), topic=topic, keyring=keyring) as client:
        assert client.wait_until_caught_up(30)
        yield client


def _published(bootstrap: str, topic: str, keyring: Keyring, *decisions: Decision) -> None:
    with DecisionPublisher(KafkaConfig(bootstrap), topic=topic, keyring=keyring) as publisher:
        assert all(publisher.publish(d) for d in decisions)
        assert publisher.flush(10)


def _decision(ts: float, action: str = "disable_speculation", bucket: str | None = "coding") -> Decision:
    return Decision(ts=ts, bundle_id="b-1", bucket=bucket, cohort=None, action=action,
                    reason="acceptance_drop", detector="al_gate", evidence={"al": 1.4})


# -- the pure API ----------------------------------------------------------------------------

def test_a_signed_line_verifies_and_any_change_breaks_it():
    ring = Keyring.from_secrets(_KEY)
    line = _decision(10.0).to_json_line().encode()
    headers = sign_line(line, ring)
    assert [name for name, _ in headers] == [SIGNATURE_HEADER]
    assert verify(line, headers, ring) is Verdict.VALID
    assert verify(line, dict(headers), ring) is Verdict.VALID  # Faust hands headers as a mapping
    assert verify(line.replace(b"10.0", b"11.0"), headers, ring) is Verdict.FORGED
    assert verify(line + b" ", headers, ring) is Verdict.FORGED
    assert verify(line, [], ring) is Verdict.UNSIGNED
    assert verify(line, [("other", b"v1")], ring) is Verdict.UNSIGNED
    assert verify(None, headers, ring) is Verdict.UNSIGNED


@pytest.mark.parametrize("header", [
    b"", b"v1", b"v1::", b"v2:%s:%s", b"v1:%s:" + b"0" * 64, b"v1:%s:" + b"g" * 64, b"v1:%s:%s:extra",
    b"\xff\xfe", b"v1:%s:" + b"a" * 10_000, None, "v1:text-not-bytes",
])
def test_malformed_signature_headers_are_forgeries_never_errors(header):
    ring = Keyring.from_secrets(_KEY)
    line = b'{"kind":"decision"}'
    good = sign_line(line, ring)[0][1].split(b":")[2]
    if isinstance(header, bytes) and b"%s" in header:
        header = header.replace(b"%s", ring.current.key_id.encode(), 1).replace(b"%s", good, 1)
    assert verify(line, [(SIGNATURE_HEADER, header)], ring) is Verdict.FORGED


def test_uppercase_hex_is_not_a_second_valid_encoding():
    ring = Keyring.from_secrets(_KEY)
    name, value = sign_line(b"x", ring)[0]
    version, key_id, digest = value.split(b":")
    assert verify(b"x", [(name, b":".join([version, key_id, digest.upper()]))], ring) is Verdict.FORGED


def test_rotation_accepts_the_previous_key_until_it_is_dropped():
    old = Keyring.from_secrets(_OLD_KEY)
    rolling = Keyring.from_secrets(_KEY, previous=_OLD_KEY)
    new = Keyring.from_secrets(_KEY)
    line = b'{"kind":"decision","ts":1.0}'
    assert verify(line, sign_line(line, old), rolling) is Verdict.VALID
    assert verify(line, sign_line(line, new), rolling) is Verdict.VALID
    assert verify(line, sign_line(line, old), new) is Verdict.UNKNOWN_KEY
    # Publishers sign with the current key only.
    assert sign_line(line, rolling)[0][1].split(b":")[1].decode() == new.current.key_id


def test_without_a_key_nothing_is_signed_and_everything_is_unchecked():
    ring = Keyring()
    assert not Keyring.from_env({}).enabled  # unset: insecure mode
    assert sign_line(b"x", ring) == []
    assert verify(b"x", [], ring) is Verdict.UNCHECKED and Verdict.UNCHECKED.accepted


def test_keys_come_from_a_file_or_the_environment_and_never_show(tmp_path, caplog):
    secret = "s3cr3t-" + uuid.uuid4().hex
    key_file = tmp_path / "signing.key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)
    from_file = Keyring.from_env({"SPECWATCH_SIGNING_KEY_FILE": str(key_file)})
    from_value = Keyring.from_env({"SPECWATCH_SIGNING_KEY": secret})
    assert from_file.current.key_id == from_value.current.key_id  # trailing newline ignored
    assert from_file.current.secret == secret.encode()
    rotated = Keyring.from_env({"SPECWATCH_SIGNING_KEY": secret, "SPECWATCH_SIGNING_PREVIOUS_KEY": "p" * 32})
    assert rotated.previous is not None and rotated.previous.key_id in repr(rotated)
    for shown in (repr(from_file), str(from_file), repr(from_file.current)):
        assert secret not in shown

    with caplog.at_level(logging.DEBUG):
        key_file.chmod(0o644)
        Keyring.from_env({"SPECWATCH_SIGNING_KEY_FILE": str(key_file)})
    assert "can be read by other users" in caplog.text and secret not in caplog.text


_SECRET = "s3cr3t-" + uuid.uuid4().hex


@pytest.mark.parametrize("environ, problem", [
    ({"SPECWATCH_SIGNING_KEY_FILE": "signing.key", "SPECWATCH_SIGNING_KEY": _SECRET}, "not both"),
    ({"SPECWATCH_SIGNING_KEY_FILE": "missing.key"}, "cannot read the signing key file: No such"),
    ({"SPECWATCH_SIGNING_KEY": "short"}, "16 to 4096 bytes long, got 5: generate one .*urandom"),
    ({"SPECWATCH_SIGNING_PREVIOUS_KEY": _SECRET}, "a previous signing key needs a current one"),
    # an empty setting is an error, not insecure mode
    ({"SPECWATCH_SIGNING_KEY": ""}, "is set but empty"),
    ({"SPECWATCH_SIGNING_KEY_FILE": ""}, "is set but empty"),
    ({"SPECWATCH_SIGNING_KEY": "  "}, "is set but empty"),
    ({"SPECWATCH_SIGNING_PREVIOUS_KEY": ""}, "is set but empty"),
    ({"SPECWATCH_SIGNING_KEY": "", "SPECWATCH_SIGNING_KEY_FILE": "k"}, "is set but empty"),
])
def test_a_bad_key_setting_is_refused_without_showing_the_key(tmp_path, environ, problem):
    (tmp_path / "signing.key").write_text(_SECRET)
    environ = {name: str(tmp_path / value) if name.endswith("_FILE") and value else value
               for name, value in environ.items()}
    with pytest.raises(ValueError, match=problem) as raised:
        Keyring.from_env(environ)
    assert _SECRET not in str(raised.value) and "short" not in str(raised.value)


_HEADER_VALUES = st.one_of(st.none(), st.binary(max_size=200), st.text(max_size=50))


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=st.binary(max_size=300), other=st.binary(max_size=300),
       headers=st.lists(st.tuples(st.sampled_from([SIGNATURE_HEADER, "x", ""]), _HEADER_VALUES), max_size=4))
def test_verify_never_raises_and_only_the_signed_line_is_valid(line, other, headers):
    ring = Keyring.from_secrets(_KEY)
    assert verify(line, headers, ring) in (Verdict.UNSIGNED, Verdict.FORGED, Verdict.UNKNOWN_KEY)
    signed = sign_line(line, ring)
    assert verify(line, headers + signed, ring) is Verdict.VALID
    assert (verify(other, signed, ring) is Verdict.VALID) == (other == line)


# -- on the real broker ------------------------------------------------------------------------

@pytest.fixture
def decisions_topic(compacted_topic):
    return compacted_topic


@pytest.fixture
def raw_producer(kafka_bootstrap):
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, api_version=_API_VERSION)
    yield producer
    producer.close()


@pytest.fixture
def send(raw_producer, decisions_topic):
    """Put a decision on the topic as is, with the headers ``headers(value)`` gives (or ``headers`` itself)."""
    def send(decision: Decision, headers=lambda value: [], key: bytes | None = None) -> None:
        value = decision.to_json_line().encode()
        raw_producer.send(decisions_topic, key=key or decision.key.encode(), value=value,
                          headers=headers(value) if callable(headers) else headers).get(timeout=10)
    return send


@pytest.mark.kafka
def test_flag_client_acts_only_on_signed_fresh_decisions(kafka_bootstrap, decisions_topic, send, caplog):
    config = KafkaConfig(kafka_bootstrap)
    ring = Keyring.from_secrets(_KEY)
    disable, restore = _decision(100.0), _decision(200.0, action="restore")
    with DecisionPublisher(config, topic=decisions_topic, keyring=ring) as publisher:
        assert publisher.publish(disable) and publisher.publish(restore)
        assert publisher.flush(10)
    assert publisher.stats() == {"published": 2, "failed": 0}

    chat_off = _decision(300.0, bucket="chat")
    send(chat_off, [])                                                              # unsigned
    send(chat_off, [(SIGNATURE_HEADER, f"v1:{ring.current.key_id}:{'ab' * 32}".encode())])  # forged
    send(chat_off, lambda value: sign_line(value, Keyring.from_secrets(_OTHER_KEY)))  # a stranger's key
    send(disable, lambda value: sign_line(value, ring))                             # replay of an old one
    send(chat_off, lambda value: sign_line(value, ring), key=b"b-1/extraction/*")   # signed, wrong key
    send(_decision(250.0, action="reduce_draft_length", bucket="extraction"),
         lambda value: sign_line(value, ring))                                      # legitimate

    with caplog.at_level(logging.WARNING, logger="specwatch.collectors.flag_client"):
        with FlagClient(config, topic=decisions_topic, keyring=ring) as client:
            assert client.wait_until_caught_up(30)
            stats = client.stats()
            assert client.lookup("b-1", "coding", "main").enabled  # the replayed disable did not win
            assert client.lookup("b-1", "chat", "main").enabled  # no forged, unsigned or misrouted one did
            assert client.lookup("b-1", "extraction", "main").draft_limit == 1
    assert (stats.applied, stats.unsigned, stats.forged, stats.replayed, stats.misrouted) == (3, 1, 2, 1, 1)
    assert (stats.undecodable, stats.tombstones) == (0, 0)
    # One rate-limited warning for the flood, naming no message content.
    ignored = [r for r in caplog.records if "ignored a" in r.getMessage()]
    assert len(ignored) == 1 and "chat" not in ignored[0].getMessage()


@pytest.mark.kafka
def test_readers_mid_rotation_accept_both_keys(kafka_bootstrap, decisions_topic):
    _published(kafka_bootstrap, decisions_topic, Keyring.from_secrets(_OLD_KEY), _decision(100.0))
    _published(kafka_bootstrap, decisions_topic, Keyring.from_secrets(_KEY),
               _decision(110.0, bucket="chat"))
    rolling_ring = Keyring.from_secrets(_KEY, previous=_OLD_KEY)
    with _caught_up(kafka_bootstrap, decisions_topic, rolling_ring) as rolling:
        assert not rolling.lookup("b-1", "coding", "m").enabled and not rolling.lookup("b-1", "chat", "m").enabled
        assert rolling.stats().applied == 2
    with _caught_up(kafka_bootstrap, decisions_topic, Keyring.from_secrets(_KEY)) as rotated:
        assert rotated.lookup("b-1", "coding", "m").enabled and not rotated.lookup("b-1", "chat", "m").enabled
        assert (rotated.stats().applied, rotated.stats().forged) == (1, 1)


@pytest.mark.kafka
def test_without_a_key_the_client_says_so_once_and_accepts_unsigned(kafka_bootstrap, decisions_topic,
                                                                     raw_producer, send, caplog):
    send(_decision(100.0), key=b"b-1/coding/*")
    key, value, _ = heartbeat_message("p-1", 0, 99.0, keyring=Keyring())
    raw_producer.send(decisions_topic, key=key, value=value).get(timeout=10)
    with caplog.at_level(logging.WARNING):
        with _caught_up(kafka_bootstrap, decisions_topic, Keyring()) as client:
            assert not client.lookup("b-1", "coding", "main").enabled
            assert (client.stats().applied, client.stats().heartbeats) == (1, 1)
    assert sum("WITHOUT a signing key" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.kafka
def test_decisions_command_leaves_out_and_reports_what_a_flag_client_would_ignore(
        kafka_bootstrap, decisions_topic, send, monkeypatch, capsys, tmp_path):
    secret = b"a key for the decisions command, 41 bytes"
    ring = Keyring.from_secrets(secret)
    signed, unsigned, forged = _decision(100.0), _decision(110.0, bucket="chat"), _decision(120.0, bucket="math")
    for decision, headers in ((signed, lambda v: sign_line(v, ring)), (unsigned, lambda v: []),
                              (forged, lambda v: sign_line(v, Keyring.from_secrets(_OTHER_KEY)))):
        send(decision, headers)
    command = ["decisions", "--bootstrap", kafka_bootstrap, "--topic", decisions_topic]

    _without_key(monkeypatch)
    assert cli.main(command) == 0  # no key: nothing is checked, everything printed
    assert capsys.readouterr().out.splitlines() == [d.to_json_line() for d in (signed, unsigned, forged)]

    key_file = tmp_path / "signing.key"
    key_file.write_bytes(secret + b"\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY_FILE", str(key_file))
    assert cli.main(command) == 3
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [signed.to_json_line()]
    assert "1 unknown_key, 1 unsigned" in captured.err and secret.decode() not in captured.err

    assert cli.main(command + ["--unverified"]) == 3
    assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.kafka
def test_manual_override_reaches_flag_clients_signed_and_clearing_returns_the_archived_state(
        kafka_bootstrap, decisions_topic, monkeypatch, tmp_path):
    ring = _with_key(monkeypatch, "a key for manual overrides, 38 bytes..")
    dsn = f"chdb://{tmp_path}/archive"
    scope = ["--archive", dsn, "--bundle", "b-1", "--bucket", "coding", "--by", "alice",
             "--bootstrap", kafka_bootstrap, "--decisions-topic", decisions_topic]
    assert cli.main(["flags", "set", *scope, "--off", "--reason", "p99 page", "--create"]) == 2  # no --code
    assert cli.main(["flags", "set", *scope, "--off", "--reason", "p99 page", "--create", "--code", "latency_slo"]) == 0

    def client_view():
        with _caught_up(kafka_bootstrap, decisions_topic, ring) as client:
            return client.lookup("b-1", "coding", "main"), client.lookup("b-1", "chat", "main"), client.stats()

    coding, chat, stats = client_view()
    assert not coding.enabled and coding.reasons == ("latency_slo",) and chat.enabled
    assert (stats.applied, stats.forged, stats.unsigned) == (1, 0, 0)

    assert cli.main(["flags", "clear", *scope, "--reason", "fixed", "--code", "latency_slo"]) == 0
    coding, _, stats = client_view()
    assert coding.enabled and stats.applied == 2


def test_manual_override_codes_are_the_contract_reasons():
    import typing

    from specwatch.commands.flags import _REASON_CODES
    from specwatch.schemas.decisions import Reason

    assert set(_REASON_CODES) == set(typing.get_args(Reason))


@pytest.mark.kafka
def test_manual_stage_change_reaches_flag_clients(kafka_bootstrap, decisions_topic, monkeypatch, tmp_path):
    from specwatch.archive.store import Archive

    _without_key(monkeypatch)
    dsn = f"chdb://{tmp_path}/archive"
    with Archive.open(dsn) as archive:
        archive.write_bundle("b-9", {"policy": {"acceptance_rule": "strict"}}, 1_767_225_600.0, "w1")
    publish = ["--archive", dsn, "--by", "alice", "--bootstrap", kafka_bootstrap, "--decisions-topic", decisions_topic,
               "--unsigned"]  # this fleet's flag clients run without a key
    assert cli.main(["bundles", "promote", "b-9", "--reason", "shadow by hand", *publish]) == 0
    assert cli.main(["bundles", "freeze", "b-9", "--reason", "tail on the canary", *publish]) == 0
    with _caught_up(kafka_bootstrap, decisions_topic, Keyring()) as client:
        assert client.store.admission("b-9").stage == "frozen"
        assert not client.lookup("b-9", "coding", "main").enabled
        assert client.stats().applied == 2


@pytest.mark.kafka
@pytest.mark.parametrize("bad", ["forged", "unsigned"])
def test_flags_list_shows_what_the_fleet_follows_and_exits_3_as_decisions_does(
        kafka_bootstrap, decisions_topic, send, monkeypatch, capsys, bad):
    ring = _with_key(monkeypatch, "a key for listing the fleet's flags, 40 b")
    good, stranger = _decision(100.0), Keyring.from_secrets(_OTHER_KEY)
    send(good, lambda value: sign_line(value, ring))
    bad_headers = (lambda value: sign_line(value, stranger)) if bad == "forged" else []
    send(_decision(110.0, bucket="chat"), bad_headers)
    listing = ["flags", "list", "--bootstrap", kafka_bootstrap,
               "--decisions-topic", decisions_topic]
    assert cli.main(listing) == 3
    captured = capsys.readouterr()
    assert f"1 {bad}" in captured.err and "b-1" in captured.out and "chat" not in captured.out
    assert cli.main([*listing, "--json"]) == 3
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["bundle_id"], r["bucket"], r["speculation"], r["decision_id"]) for r in rows] == [
        ("b-1", "coding", "off", good.id)]
    assert cli.main(["decisions", "--bootstrap", kafka_bootstrap, "--topic", decisions_topic]) == 3
    assert capsys.readouterr().out.splitlines() == [good.to_json_line()]


# -- a manual change engines would ignore is never reported as a success ----------------------

def _override(dsn: str, kafka_bootstrap: str, topic: str, *extra: str) -> list[str]:
    return ["flags", "set", "--archive", dsn, "--bundle", "b-1", "--bucket", "coding", "--by", "alice",
            "--off", "--reason", "p99 page", "--create", "--code", "latency_slo", "--bootstrap", kafka_bootstrap,
            "--decisions-topic", topic, *extra]


@pytest.mark.kafka
def test_an_override_without_a_key_is_refused_before_anything_is_recorded(
        kafka_bootstrap, decisions_topic, monkeypatch, tmp_path, capsys):
    _without_key(monkeypatch)
    dsn = f"chdb://{tmp_path}/archive"
    assert cli.main(_override(dsn, kafka_bootstrap, decisions_topic)) == 2
    err = capsys.readouterr().err
    assert err.startswith("specwatch flags: no signing key, so flag clients that hold one would ignore this change")
    assert "--unsigned" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "archive").exists()  # nothing archived, nothing published

    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", "")
    assert cli.main(_override(dsn, kafka_bootstrap, decisions_topic)) == 2
    assert capsys.readouterr().err == ("specwatch flags: SPECWATCH_SIGNING_KEY is set but empty: give it the key, "
                                       "or unset it to run without signing\n")
    assert cli.main(["flags", "list", "--bootstrap", kafka_bootstrap, "--decisions-topic", decisions_topic]) == 2
    assert "is set but empty" in capsys.readouterr().err
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", "a key that is set, 33 bytes long")
    assert cli.main(_override(dsn, kafka_bootstrap, decisions_topic, "--unsigned")) == 2
    assert "--unsigned, but a signing key is configured" in capsys.readouterr().err
    assert not (tmp_path / "archive").exists()

    monkeypatch.delenv("SPECWATCH_SIGNING_KEY")
    assert cli.main(_override(dsn, kafka_bootstrap, decisions_topic, "--unsigned")) == 0
    assert "override set" in capsys.readouterr().out
    with _caught_up(kafka_bootstrap, decisions_topic, Keyring()) as client:
        assert not client.lookup("b-1", "coding", "main").enabled
        assert (client.stats().applied, client.stats().unsigned) == (1, 0)
    # what an engine with a key does
    with _caught_up(kafka_bootstrap, decisions_topic, Keyring.from_secrets(_KEY)) as client:
        assert client.lookup("b-1", "coding", "main").enabled
        assert (client.stats().applied, client.stats().unsigned) == (0, 1)


@pytest.mark.parametrize("command", [["run", "--bootstrap", "127.0.0.1:9"], ["decisions", "--bootstrap", "127.0.0.1:9"]])
def test_commands_refuse_an_empty_key_setting_before_any_work(monkeypatch, capsys, command):
    monkeypatch.delenv("SPECWATCH_SIGNING_KEY_FILE", raising=False)
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", "")
    assert cli.main(command) == 2
    assert capsys.readouterr().err == (f"specwatch {command[0]}: SPECWATCH_SIGNING_KEY is set but empty: give it "
                                       "the key, or unset it to run without signing\n")


def test_a_stage_change_without_a_key_is_refused_before_the_archive_is_touched(monkeypatch, capsys, tmp_path):
    _without_key(monkeypatch)
    assert cli.main(["bundles", "promote", "b-9", "--by", "alice", "--reason", "shadow by hand",
                     "--archive", f"chdb://{tmp_path}/archive", "--bootstrap", "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.startswith("specwatch bundles: no signing key, so flag clients that hold one "
                                              "would ignore this change")
    assert not (tmp_path / "archive").exists()
