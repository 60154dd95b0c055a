"""Shared fixtures. Real parts (Kafka broker, vLLM) are started by deploy/test.sh."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Bootstrap address of the real broker that deploy/test.sh started.

    Never skips: a test that needs Kafka fails loudly when the broker is missing.
    """
    address = os.environ.get("SPECWATCH_TEST_BOOTSTRAP")
    if not address:
        pytest.fail("SPECWATCH_TEST_BOOTSTRAP is not set: run the tests through deploy/test.sh, "
                    "which starts the real Kafka broker (deploy/kafka/broker.sh start)")
    return address
