"""Secrets stay secret: planted random passwords and keys never show in logs (at DEBUG), reprs,
errors or archived rows, and prompt text never reaches the archive in clear."""

from __future__ import annotations

import json
import logging
import os

import pytest

from specwatch.archive.errors import ArchiveError
from specwatch.archive.store import Archive
from specwatch.actions.sinks.publisher import DecisionPublisher
from specwatch.collectors.flag_client import FlagClient
from specwatch.archive.sink import ArchiveSink
from specwatch.transport.signing import Keyring
from specwatch.collectors.otel import TelemetryEmitter
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Decision, Policy, RequestRecord
from specwatch.schemas.outputs import ActionRecord, SliceOutput

from machine import free_port
from telemetry_log import replayed, step_record


def _secret(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"


@pytest.fixture
def every_log(caplog):
    """Everything logged by anyone (kafka-python and clickhouse-connect included), at DEBUG."""
    caplog.set_level(logging.DEBUG)
    return caplog


def test_kafka_sasl_and_ssl_passwords_never_leave_the_config(every_log):
    sasl, ssl = _secret("sasl"), _secret("sslkey")
    config = KafkaConfig(f"127.0.0.1:{free_port()}", security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                         sasl_username="svc", sasl_password=sasl, ssl_password=ssl, max_block_ms=100,
                         request_timeout_ms=500, delivery_timeout_ms=1_000)
    shown = [repr(config), str(config)]
    exporter = KafkaTelemetryExporter(config)
    shown.append(repr(exporter))
    emitter = TelemetryEmitter(exporter, sdk=False, schedule_delay_millis=10, shutdown_timeout_millis=2_000)
    record = step_record("w1", 0)
    for _ in range(20):
        emitter.emit(record)
    emitter.force_flush(3_000)
    emitter.shutdown()
    assert exporter.stats()["records"] + exporter.stats()["send_errors"] > 0  # the paths really ran
    with DecisionPublisher(config, keyring=Keyring(), topic="t") as publisher:
        publisher.publish(Decision(ts=1.0, bundle_id="b", action="alert", reason="draft_overhead", detector="d"))
        publisher.flush(1)
    client = FlagClient(config, keyring=Keyring(), connect_timeout_s=0.5, retry_backoff_s=0.1).start()
    client.wait_until_caught_up(1.0)
    client.stop()
    shown.append(repr(client.stats()))
    for text in [every_log.text, *shown]:
        assert sasl not in text and ssl not in text
    assert any(r.name.startswith("kafka") for r in every_log.records)  # the client library did log


def test_clickhouse_credentials_stay_out_of_errors_logs_and_the_spool(tmp_path, every_log, monkeypatch):
    in_dsn, in_env = _secret("dsnpw"), _secret("envpw")
    port = free_port()
    errors = []
    with pytest.raises(ArchiveError, match=f"127.0.0.1:{port}") as raised:
        Archive.open(f"http://ops:{in_dsn}@127.0.0.1:{port}/specwatch")
    errors.append(raised.value)
    monkeypatch.setenv("SPECWATCH_CLICKHOUSE_USER", "ops")
    monkeypatch.setenv("SPECWATCH_CLICKHOUSE_PASSWORD", in_env)
    with pytest.raises(ArchiveError, match=f"127.0.0.1:{port}") as raised:
        Archive.open(f"https://127.0.0.1:{port}/specwatch")
    errors.append(raised.value)
    with pytest.raises(ValueError, match="scheme") as raised:
        Archive.open(f"ftp://ops:{in_dsn}@host/db")
    errors.append(raised.value)
    with pytest.raises(ValueError, match="plain identifier"):
        Archive.open(f"http://127.0.0.1:{port}/bad-name;drop")

    sink = ArchiveSink.open(f"http://ops:{in_dsn}@127.0.0.1:{port}/specwatch", spool=tmp_path / "spool")
    pipeline = replayed(Simulator("bundle_change", seed=3, minutes=0.1, workers=2, incident_at=0.5).records(),
                        sinks=[sink])
    sink.close()
    assert sink.stats()["spooled"] > 0 and pipeline.decisions
    spooled = b"".join(p.read_bytes() for p in (tmp_path / "spool").iterdir())
    texts = [every_log.text, repr(sink.spool), json.dumps(sink.stats())] + [
        f"{e!r} {e} {e.__cause__!r} {e.__context__!r}" for e in errors]
    for text in texts:
        assert in_dsn not in text and in_env not in text
    assert in_dsn.encode() not in spooled and in_env.encode() not in spooled


def test_nothing_secret_or_prompt_like_lands_in_archived_rows(tmp_path, monkeypatch, every_log):
    ch_password, signing_key, prompt = _secret("chpw"), _secret("signing-key"), _secret("PROMPT")
    monkeypatch.setenv("SPECWATCH_CLICKHOUSE_PASSWORD", ch_password)
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", signing_key)
    keyring = Keyring.from_env()
    records = list(Simulator("demo", seed=3, minutes=1.5, workers=2, concurrency=4, incident_at=20.0).records())
    # An engine whose error messages quote the prompt: the worst case for samples.
    records = [r.model_copy(update={"error": f"{r.error}: while decoding '{prompt}'"})
               if isinstance(r, RequestRecord) and r.error else r for r in records]
    assert any(isinstance(r, RequestRecord) and r.error and prompt in r.error for r in records)
    failed = next(r for r in records if isinstance(r, RequestRecord) and r.error)
    policy = Policy.model_validate({"baseline": {"learn_seconds": 10}})
    with Archive.open(f"chdb://{tmp_path / 'archive'}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool")
        assert replayed(records, policy=policy, sinks=[sink]).decisions
        # And one decision whose sample is surely a failed request quoting its prompt.
        decision = Decision(ts=failed.ts, bundle_id=failed.bundle_id, bucket=failed.bucket, action="alert",
                            reason="error_rate", detector="error_gate", sample_ids=[failed.id])
        sink(SliceOutput(slice_index=0, slice_end=failed.ts,
                         actions=[ActionRecord(decision, {}, [failed.model_dump(mode="json")])]))
        sink.close()
        dumped = []
        for table in ("decisions", "audit", "samples", "window_stats", "bundles", "overrides"):
            _, rows = archive.sql(f"SELECT * FROM specwatch.{table}")
            dumped.append(json.dumps(rows, default=str))
        archived = "\n".join(dumped)
    assert "request" in archived and "sha256:" in archived  # samples were archived, errors as digests
    for secret in (ch_password, signing_key, prompt):
        assert secret not in archived and secret not in every_log.text
    assert keyring.current.key_id not in archived  # nor is the key id: it is not archive data
    assert signing_key not in repr(keyring)
