"""A vLLM engine wired to Kafka by environment variables alone, as `vllm serve` is: a signed
decision between two waves turns coding off, so the second wave drafts for chat only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kafka_helpers import topic_messages
from vllm_scenario import PROMPTS, engine_env, flag_decision, ngram_llm_and_params

pytestmark = [pytest.mark.vllm, pytest.mark.kafka]

_KEY = "a signing key for the vLLM Kafka test, 44 bytes"
_MAX_TOKENS = 32
_PATIENCE_S = 300.0  # liveness on a loaded machine, not a performance bound
_SUBPROCESS_TIMEOUT_S = 900


def _wait_for(path: Path, deadline: float, proc: subprocess.Popen) -> str:
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the engine exited ({proc.returncode}) before {path.name}:\n"
                        f"{(path.parent / 'engine.log').read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.1)
    return path.read_text()


def _scenario(out_dir: Path) -> None:
    """Runs in the subprocess: the plain vLLM LLM API; specwatch comes in through the plugin and env."""
    from specwatch.collectors.vllm.plugin import collector_for

    llm, params = ngram_llm_and_params(_MAX_TOKENS)
    llm.generate(PROMPTS, params, use_tqdm=False)
    collector = collector_for("test")
    (bundle_id,) = collector.bundles
    (out_dir / "wave1.json").write_text(json.dumps({"bundle_id": bundle_id, "ts": time.time()}))
    deadline = time.monotonic() + _PATIENCE_S
    while collector.flags.lookup(bundle_id, "coding", "main").enabled:  # the decision, from Kafka
        if time.monotonic() > deadline:
            raise SystemExit("the engine's flag client never saw the decision")
        time.sleep(0.1)
    (out_dir / "wave2.json").write_text(json.dumps({"ts": time.time()}))
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    # the collector's and the emitter's queues are flushed to Kafka at exit


def _telemetry(bootstrap: str, topic: str) -> list:
    from specwatch.schemas import Rejection
    from specwatch.schemas.otlp import decode_request

    records = [r for m in topic_messages(bootstrap, topic) for r in decode_request(m.value)]
    assert records and not [r for r in records if isinstance(r, Rejection)]
    return records


@pytest.fixture(scope="module")
def run(kafka_bootstrap, tmp_path_factory) -> dict:
    from kafka.admin import KafkaAdminClient, NewTopic

    from specwatch.actions.sinks.publisher import DecisionPublisher
    from specwatch.transport.signing import Keyring
    from specwatch.transport.config import KafkaConfig

    out = tmp_path_factory.mktemp("vllm-kafka")
    name = f"test.vllm.{uuid.uuid4().hex[:8]}"
    telemetry, decisions = f"{name}.telemetry", f"{name}.decisions"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, api_version=(4, 0))
    admin.create_topics([NewTopic(telemetry, 2, 1),
                         NewTopic(decisions, 1, 1, topic_configs={"cleanup.policy": "compact"})])
    env = engine_env(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        SPECWATCH_VLLM_SINK="specwatch.collectors.vllm.kafka:telemetry_sink",
        SPECWATCH_VLLM_FLAGS="specwatch.collectors.vllm.kafka:decision_flags",
        SPECWATCH_VLLM_WORKER="serve-0",
        SPECWATCH_TELEMETRY_SPOOL_DIR=str(out / "spool"),  # never a spool left by another run
        SPECWATCH_KAFKA_BOOTSTRAP=kafka_bootstrap, SPECWATCH_TELEMETRY_TOPIC=telemetry,
        SPECWATCH_DECISIONS_TOPIC=decisions, SPECWATCH_SIGNING_KEY=_KEY)
    env.pop("SPECWATCH_SIGNING_KEY_FILE", None)
    log = open(out / "engine.log", "w")  # a file, not a pipe: nobody reads while the engine runs
    proc = subprocess.Popen([sys.executable, __file__, str(out)], stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    try:
        deadline = time.monotonic() + _SUBPROCESS_TIMEOUT_S
        wave1 = json.loads(_wait_for(out / "wave1.json", deadline, proc))
        off = flag_decision(wave1["bundle_id"], "disable_speculation", "coding")
        with DecisionPublisher(KafkaConfig(kafka_bootstrap), topic=decisions,
                               keyring=Keyring.from_secrets(_KEY)) as publisher:
            assert publisher.publish(off) and publisher.flush(30)
        proc.wait(timeout=_SUBPROCESS_TIMEOUT_S)
        if proc.returncode != 0:
            pytest.fail(f"vLLM scenario failed (exit {proc.returncode}):\n{(out / 'engine.log').read_text()[-6000:]}")
        wave2 = json.loads((out / "wave2.json").read_text())
        records = _telemetry(kafka_bootstrap, telemetry)
    finally:
        if proc.poll() is None:
            proc.kill()
        admin.delete_topics([telemetry, decisions])
        admin.close()
    return {"bundle_id": wave1["bundle_id"], "switch_ts": wave2["ts"], "records": records}


def _rounds(run, after: bool) -> dict[str, list[int]]:
    drafted: dict[str, list[int]] = {}
    for record in run["records"]:
        if record.kind == "step" and (record.ts > run["switch_ts"]) == after:
            for entry in record.requests:
                drafted.setdefault(entry.bucket, []).append(entry.drafted)
    return drafted


def test_telemetry_reaches_kafka_from_an_engine_configured_by_environment(run):
    kinds = {r.kind for r in run["records"]}
    assert {"bundle", "step", "request"} <= kinds
    assert {r.worker for r in run["records"] if r.kind == "step"} == {"serve-0"}
    before = _rounds(run, after=False)
    assert sum(before["coding"]) > 0 and sum(before["chat"]) > 0


def test_a_signed_decision_on_kafka_turns_the_coding_bucket_off_in_the_engine(run):
    after = _rounds(run, after=True)
    assert after["coding"] and set(after["coding"]) == {0}
    assert sum(after["chat"]) > 0
    requests = [r for r in run["records"] if r.kind == "request" and r.ts > run["switch_ts"]]
    assert {r.bucket for r in requests if not r.speculative} == {"coding"}


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
