"""Shared fixtures. Real parts (Kafka broker, vLLM) are started by deploy/test.sh."""

from __future__ import annotations

import os
import uuid
from functools import cache
from pathlib import Path
from typing import Iterator

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    """With several test processes (deploy/test.sh runs two), tests of one shared real part run in
    one process, one after another, as in a single-process run: the vLLM tests (each starts engines
    that take both cores and gigabytes), and the tests on the one Kafka broker (several use the
    default topic names). Everything else spreads over the processes."""
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif item.get_closest_marker("kafka") or "kafka_bootstrap" in item.fixturenames or _uses_broker(item.path):
            item.add_marker(pytest.mark.xdist_group("kafka"))


@cache
def _uses_broker(path: Path) -> bool:
    return "SPECWATCH_TEST_BOOTSTRAP" in path.read_text(encoding="utf-8")


@pytest.fixture(scope="session", autouse=True)
def _archive_of_this_process(tmp_path_factory) -> Iterator[None]:
    """Under several test processes each has its own default archive, as a chDB archive opens in
    one process only; a single-process run keeps the default (``specwatch-data/archive``)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("SPECWATCH_ARCHIVE"):
        yield
        return
    os.environ["SPECWATCH_ARCHIVE"] = f"chdb://{tmp_path_factory.mktemp('default-archive')}"
    yield
    os.environ.pop("SPECWATCH_ARCHIVE", None)


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
