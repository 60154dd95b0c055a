"""The standard OpenTelemetry deployment: a real Collector per test, on free ports with a
documented config of deploy/otelcol/, and the real Kafka broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from functools import partial
from pathlib import Path

import pytest
from aiokafka.admin import NewTopic
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from specwatch.schemas import Decision, Rejection
from specwatch.schemas.otlp import decode_request

from otelcol import CONFIGS, Collector
from kafka_helpers import (INCIDENT_AT, MINUTES, PARTITIONS, SEED, TAIL_SECONDS, WORKERS, Feed, Pipeline,
                           create_topics, delete_topics, run_async, topic_messages)
from telemetry_log import decision_key, step_record
from machine import free_port, specwatch_ok

pytestmark = pytest.mark.kafka

_RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="module", autouse=True)
def _topics_cleaned(kafka_bootstrap):
    yield
    run_async(delete_topics(kafka_bootstrap, f"swotel-{_RUN}-"))


def _topic(bootstrap: str, name: str, partitions: int = PARTITIONS) -> str:
    topic = f"swotel-{_RUN}-{name}-{uuid.uuid4().hex[:4]}.telemetry"
    run_async(create_topics(bootstrap, NewTopic(topic, partitions, 1)))
    return topic


def _config(tmp_path: Path, name: str, replace: dict[str, str] | None = None) -> Path:
    """A documented config, copied to tmp_path; ``replace`` changes lines of it (a variant)."""
    text = (CONFIGS / name).read_text()
    for old, new in (replace or {}).items():
        assert old in text, f"{name} no longer has {old!r}"
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def _agent(tmp_path: Path, bootstrap: str, topic: str, replace: dict[str, str] | None = None) -> tuple[Collector, str, str]:
    http, grpc = free_port(), free_port()
    collector = Collector(_config(tmp_path, "agent.yaml", replace),
                          {"SPECWATCH_KAFKA_BOOTSTRAP": bootstrap, "SPECWATCH_TELEMETRY_TOPIC": topic,
                           "OTELCOL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http}",
                           "OTELCOL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc}"}, tmp_path / "otelcol.log")
    return collector, f"http://127.0.0.1:{http}", f"http://127.0.0.1:{grpc}"


def _resource(value: bytes) -> list[dict]:
    request = ExportLogsServiceRequest.FromString(value)
    return [{kv.key: kv.value.string_value for kv in rl.resource.attributes} for rl in request.resource_logs]


_cli = partial(specwatch_ok, timeout=900)


def _replayed(tmp_path: Path, scenario: str) -> tuple[int, float, list[Decision]]:
    """The scenario's records through `specwatch replay`: record count, cutoff, decisions."""
    from specwatch.lab.simulation.simulator import Simulator

    records = tmp_path / "telemetry.jsonl"
    _cli("simulate", "--output", str(records), "--scenario", scenario, "--seed", str(SEED), "--workers",
         str(WORKERS), "--minutes", str(MINUTES), "--incident-at", str(INCIDENT_AT))
    decisions = tmp_path / "decisions.jsonl"
    _cli("replay", str(records), "--output", str(decisions))
    sim = Simulator(scenario, seed=SEED, workers=WORKERS, minutes=MINUTES, incident_at=INCIDENT_AT)
    count = sum(1 for _ in records.open())
    return count, sim.end_ts - TAIL_SECONDS, [Decision.model_validate_json(line) for line in decisions.open()]


def _otlp_to_run(tmp_path: Path, bootstrap: str, keyed: bool) -> tuple[Feed, Pipeline, list]:
    """simulator -> OTLP/HTTP -> the agent Collector -> Kafka -> `specwatch run`; and what replay decides."""
    scenario = "acceptance_drop"
    count, cutoff, replayed = _replayed(tmp_path, scenario)
    expected = sorted(decision_key(d) for d in replayed if d.ts < cutoff)
    assert expected, "replay decides nothing: the comparison would be empty"
    topic = _topic(bootstrap, "keyed" if keyed else "unkeyed")
    replace = None if keyed else {"partition_logs_by_resource_attributes: true":
                                  "partition_logs_by_resource_attributes: false"}
    collector, http, _ = _agent(tmp_path, bootstrap, topic, replace)
    with collector:
        _cli("simulate", "--otlp", http, "--scenario", scenario, "--seed", str(SEED), "--workers", str(WORKERS),
             "--minutes", str(MINUTES), "--incident-at", str(INCIDENT_AT))
        collector.wait_for(lambda: collector.metrics().get("otelcol_exporter_sent_log_records", 0) >= count,
                           f"the Collector sending all {count} records to Kafka")
        metrics = collector.metrics()
    assert metrics["otelcol_exporter_sent_log_records"] == count
    assert metrics.get("otelcol_exporter_send_failed_log_records", 0) == 0
    feed = Feed(scenario, topic, cutoff, expected, {}, count)
    pipeline = Pipeline(bootstrap, feed, tmp_path)
    return feed, pipeline, topic_messages(bootstrap, topic)


def _assert_run_decides_as_replay(pipeline: Pipeline) -> None:
    try:
        pipeline.decide()
    finally:
        pipeline.stop()


def _partitions_of_workers(messages: list, feed: Feed) -> dict[str, set[int]]:
    """The partitions each worker's records came on; checks all of ``feed`` came, none rejected."""
    partitions, records = defaultdict(set), 0
    for message in messages:
        decoded = decode_request(message.value)
        assert not [r for r in decoded if isinstance(r, Rejection)]
        records += len(decoded)
        for worker in {r.worker for r in decoded if r.kind != "shadow"}:
            partitions[worker].add(message.partition)
    assert records == feed.telemetry_records
    return partitions


def test_engines_through_the_agent_collector_keyed_by_resource_decide_as_replay(kafka_bootstrap, tmp_path):
    feed, pipeline, messages = _otlp_to_run(tmp_path, kafka_bootstrap, keyed=True)
    for message in messages:
        (resource,) = _resource(message.value)  # one worker per message: keyed by its resource
        workers = {r.worker for r in decode_request(message.value) if r.kind != "shadow"}
        assert workers <= {resource["service.instance.id"]}
        assert message.key, "a message without a key"
    partitions = _partitions_of_workers(messages, feed)
    assert sorted(partitions) == [f"w{i}" for i in range(1, WORKERS + 1)]
    assert all(len(p) == 1 for p in partitions.values()), partitions  # each worker on one partition
    _assert_run_decides_as_replay(pipeline)


def test_engines_through_the_agent_collector_unkeyed_decide_as_replay(kafka_bootstrap, tmp_path, capsys):
    """The Collector's default, messages with no key: a worker's records spread over partitions."""
    feed, pipeline, messages = _otlp_to_run(tmp_path, kafka_bootstrap, keyed=False)
    assert not [m for m in messages if m.key]
    partitions = _partitions_of_workers(messages, feed)
    assert all(len(p) > 1 for p in partitions.values()), partitions  # what the test is about
    with capsys.disabled():
        print(f"\nunkeyed: partitions per worker {dict((w, sorted(p)) for w, p in partitions.items())}")
    _assert_run_decides_as_replay(pipeline)


def test_specwatch_topic_through_the_kafka_receiver_reaches_the_file_exporter_whole(kafka_bootstrap, tmp_path):
    from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
    from specwatch.transport.config import KafkaConfig

    topic = _topic(kafka_bootstrap, "receiver")
    steps = [_step(f"w{w}", seq) for w in range(3) for seq in range(700)]
    exporter = KafkaTelemetryExporter(KafkaConfig(kafka_bootstrap, topic=topic))
    for start in range(0, len(steps), 500):
        exporter.export(steps[start:start + 500])
    assert exporter.force_flush(60_000)
    exporter.shutdown()
    assert exporter.stats()["records"] == len(steps) and exporter.stats()["records_failed"] == 0

    out = tmp_path / "telemetry.jsonl"
    collector = Collector(_config(tmp_path, "telemetry-to-file.yaml"),
                          {"SPECWATCH_KAFKA_BOOTSTRAP": kafka_bootstrap, "SPECWATCH_TELEMETRY_TOPIC": topic,
                           "OTELCOL_KAFKA_GROUP_ID": f"swotel-{_RUN}-file", "OTELCOL_FILE_PATH": str(out)},
                          tmp_path / "otelcol.log")
    with collector:
        collector.wait_for(lambda: collector.metrics().get("otelcol_exporter_sent_log_records", 0) >= len(steps),
                           "the file exporter writing every record")
        time.sleep(1.0)  # anything beyond the count would show now
        metrics = collector.metrics()
    assert metrics["otelcol_exporter_sent_log_records"] == len(steps)
    written = []
    for line in out.read_text().splitlines():
        for resource_logs in json.loads(line)["resourceLogs"]:
            for scope_logs in resource_logs["scopeLogs"]:
                for record in scope_logs["logRecords"]:
                    attributes = {a["key"]: a["value"] for a in record["attributes"]}
                    written.append((attributes["specwatch.worker"]["stringValue"],
                                    int(attributes["specwatch.seq"]["intValue"])))
    assert sorted(written) == sorted((s.worker, s.seq) for s in steps)  # every record, once


def _step(worker: str, seq: int):
    return step_record(worker, seq, requests=16)


def _one_big_batch(tmp_path: Path, bootstrap: str, replace: dict[str, str] | None, count: int) -> dict:
    """``count`` step records of one worker in one OTLP/HTTP request through the agent config (or a variant)."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    from specwatch.collectors.otlp_export import OtlpTelemetryExporter

    tmp_path.mkdir(exist_ok=True)
    topic = _topic(bootstrap, "batch", partitions=1)
    collector, http, _ = _agent(tmp_path, bootstrap, topic, replace)
    steps = [_step("w-big", seq) for seq in range(count)]
    with collector:
        exporter = OtlpTelemetryExporter(OTLPLogExporter(endpoint=f"{http}/v1/logs", timeout=60))
        assert exporter.export(steps).name == "SUCCESS"
        exporter.shutdown()
        collector.wait_for(lambda: collector.metrics().get("otelcol_exporter_sent_log_records", 0)
                           + collector.metrics().get("otelcol_exporter_send_failed_log_records", 0) >= count
                           or "MESSAGE_TOO_LARGE" in collector.log.read_text(),
                           "the Collector finishing the batch")
        log = collector.log.read_text()
    messages = topic_messages(bootstrap, topic)
    arrived = sorted(r.seq for m in messages for r in decode_request(m.value))
    return {"arrived": arrived, "too_large": "MESSAGE_TOO_LARGE" in log,
            "largest_message": max((len(m.value) for m in messages), default=0)}


def test_the_agent_config_caps_batches_under_kafkas_message_limit(kafka_bootstrap, tmp_path, capsys):
    count = 8_192
    capped = _one_big_batch(tmp_path / "capped", kafka_bootstrap, None, count)
    assert capped["arrived"] == list(range(count)) and not capped["too_large"]
    assert capped["largest_message"] < 1_000_000
    # The same batch with the cap taken out: Kafka refuses the message and the records are lost.
    uncapped = _one_big_batch(tmp_path / "uncapped", kafka_bootstrap,
                              {"send_batch_size: 256": "send_batch_size: 8192",
                               "send_batch_max_size: 256": "send_batch_max_size: 0"}, count)
    assert uncapped["too_large"] and len(uncapped["arrived"]) < count
    with capsys.disabled():
        print(f"\nbatch cap: {count} step records of 16 requests in one OTLP request; agent config: "
              f"{len(capped['arrived'])} arrived, largest message {capped['largest_message']} bytes; uncapped: "
              f"{len(uncapped['arrived'])} arrived, MESSAGE_TOO_LARGE")


# ---------------------------------------------------------------- a real vLLM engine


_ENGINE_WORKER = "serve-otlp-0"


def _engine_scenario(out_dir: Path) -> None:
    """Runs in the subprocess: the plain vLLM LLM API; specwatch comes in through the plugin and env."""
    from vllm_scenario import PROMPTS, ngram_llm_and_params

    from specwatch.collectors.vllm.plugin import collector_for

    llm, params = ngram_llm_and_params(32)
    llm.generate(PROMPTS, params, use_tqdm=False)
    (out_dir / "engine.json").write_text(json.dumps({"worker": collector_for("test").worker}))
    llm.llm_engine.engine_core.shutdown()
    # the collector's queue is exported at exit


@pytest.mark.vllm
def test_a_vllm_engine_exports_otlp_grpc_through_the_collector_to_kafka(kafka_bootstrap, tmp_path):
    """Standard variables only: OTLP/gRPC to the agent Collector; the worker is service.instance.id."""
    topic = _topic(kafka_bootstrap, "vllm")
    collector, _, grpc = _agent(tmp_path, kafka_bootstrap, topic)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SPECWATCH_VLLM_", "SPECWATCH_KAFKA_", "SPECWATCH_EXPORTER", "OTEL_"))}
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "SPECWATCH_VLLM_SINK": "specwatch.collectors.vllm.sink:telemetry_sink",
        "SPECWATCH_TELEMETRY_SPOOL_DIR": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": grpc, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={_ENGINE_WORKER},deployment.environment=test",
    })
    with collector:
        with open(tmp_path / "engine.log", "w") as log:
            done = subprocess.run([sys.executable, __file__, str(tmp_path)], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, timeout=900)
        assert done.returncode == 0, (tmp_path / "engine.log").read_text()[-6000:]
        accepted = lambda: collector.metrics().get("otelcol_receiver_accepted_log_records", 0)  # noqa: E731
        assert accepted() > 0, "the engine sent nothing"
        collector.wait_for(lambda: collector.metrics().get("otelcol_exporter_sent_log_records", 0) >= accepted(),
                           "the Collector sending every record it accepted")
        sent = collector.metrics()["otelcol_exporter_sent_log_records"]
    assert json.loads((tmp_path / "engine.json").read_text()) == {"worker": _ENGINE_WORKER}
    records = []
    for message in topic_messages(kafka_bootstrap, topic):
        decoded = decode_request(message.value)
        (resource,) = _resource(message.value)
        assert resource["service.instance.id"] == _ENGINE_WORKER and resource["deployment.environment"] == "test"
        records += decoded
    assert not [r for r in records if isinstance(r, Rejection)]
    assert len(records) == sent
    assert {"bundle", "step", "request"} <= {r.kind for r in records}
    assert {r.worker for r in records} == {_ENGINE_WORKER}
    assert sum(e.drafted for r in records if r.kind == "step" for e in r.requests) > 0


if __name__ == "__main__":
    _engine_scenario(Path(sys.argv[1]))
