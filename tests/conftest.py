"""Shared fixtures. Real parts (Kafka broker, vLLM) are started by deploy/test.sh."""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _no_fixed_web_port() -> Iterator[None]:
    """`specwatch run` workers started by tests serve no web port unless a test picks a free one."""
    previous = os.environ.get("SPECWATCH_WEB_PORT")
    os.environ["SPECWATCH_WEB_PORT"] = "0"
    yield
    if previous is None:
        os.environ.pop("SPECWATCH_WEB_PORT", None)
    else:
        os.environ["SPECWATCH_WEB_PORT"] = previous


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The real broker that deploy/test.sh started; never skips: without it, Kafka tests fail."""
    address = os.environ.get("SPECWATCH_TEST_BOOTSTRAP")
    if not address:
        pytest.fail("SPECWATCH_TEST_BOOTSTRAP is not set: run the tests through deploy/test.sh, "
                    "which starts the real Kafka broker (deploy/kafka/broker.sh start)")
    return address


@pytest.fixture
def compacted_topic(kafka_bootstrap) -> Iterator[str]:
    """A new one-partition compacted topic on the test broker (a decisions topic), deleted after."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, api_version=(4, 0))
    name = f"test.compacted.{uuid.uuid4().hex[:12]}"
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs={"cleanup.policy": "compact"})])
        yield name
        admin.delete_topics([name])
    finally:
        admin.close()
