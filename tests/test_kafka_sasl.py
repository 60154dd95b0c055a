"""The stream processors on a cluster that wants SASL (credentials from SPECWATCH_KAFKA_*), on its
SASL listener only; with a wrong password the worker must say so and stop."""

from __future__ import annotations

import pytest

from specwatch.lab.bench.broker import OwnBroker, forget_broker_data, port_from_env

from kafka_helpers import Pipeline, make_feed
from machine import specwatch

pytestmark = pytest.mark.kafka

# P: PLAINTEXT, P + 1: the KRaft controller, P + 2: SASL_PLAINTEXT
_PORT, _PORT_OF_THIS_RUN = port_from_env("SPECWATCH_SASL_KAFKA_PORT", length=3)
_SASL_PORT = _PORT + 2
_USER, _PASSWORD = "svc-specwatch", "a sasl password, not logged"
_broker = OwnBroker(_PORT, partitions=4, extra=("--sasl-port", str(_SASL_PORT), "--sasl-user", f"{_USER}:{_PASSWORD}"))


@pytest.fixture(scope="module")
def sasl_broker():
    with _broker.running() as address:
        yield address, f"127.0.0.1:{_SASL_PORT}"
    if _PORT_OF_THIS_RUN:
        forget_broker_data(_PORT)


def _credentials(monkeypatch, password: str) -> None:
    monkeypatch.setenv("SPECWATCH_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("SPECWATCH_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("SPECWATCH_KAFKA_SASL_USERNAME", _USER)
    monkeypatch.setenv("SPECWATCH_KAFKA_SASL_PASSWORD", password)


def test_worker_with_sasl_credentials_decides_as_embedded(sasl_broker, tmp_path, monkeypatch):
    plain, sasl = sasl_broker
    feed = make_feed(plain, "acceptance_drop")
    _credentials(monkeypatch, _PASSWORD)
    pipeline = Pipeline(plain, feed, tmp_path, worker_bootstrap=sasl)  # the test's helpers on PLAINTEXT
    try:
        pipeline.decide()
        assert _PASSWORD not in pipeline.logs()
    finally:
        pipeline.stop()


def test_wrong_password_is_a_clear_error_not_a_hang(sasl_broker, tmp_path, monkeypatch):
    _, sasl = sasl_broker
    _credentials(monkeypatch, "not the password")
    done = specwatch("run", "--bootstrap", sasl, "--app-id", "sasl-refused", "--data-dir", str(tmp_path), timeout=300)
    assert done.returncode != 0
    assert "not the password" not in done.stderr + done.stdout
    assert "SPECWATCH_KAFKA_* security settings" in done.stderr
    print(f"\n[sasl] wrong password: exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:300]}")
