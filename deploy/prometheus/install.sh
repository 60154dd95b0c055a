#!/usr/bin/env bash
# Installs Debian's Prometheus (with promtool) and Alertmanager for the operations tests
# (rules checked and unit-tested by promtool; a live worker scraped, alerts routed both
# ways). Idempotent: does nothing when all three are already on PATH. The packages'
# system services are not used: tests start their own servers on free ports.
#   deploy/prometheus/install.sh     prints the prometheus binary's path on stdout
set -euo pipefail
source "$(dirname "$0")/../debian_install.sh"
have_all() {
  command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    && command -v prometheus-alertmanager >/dev/null 2>&1
}
if ! have_all; then
  debian_install prometheus prometheus prometheus-alertmanager
fi
if ! have_all; then
  echo "prometheus: prometheus, promtool or prometheus-alertmanager is not on PATH after installing them" >&2
  exit 1
fi
command -v prometheus
