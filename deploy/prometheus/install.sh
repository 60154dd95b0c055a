#!/usr/bin/env bash
# Installs Debian's Prometheus (with promtool) and Alertmanager for the operations tests
# (rules checked and unit-tested by promtool; a live worker scraped, alerts routed both
# ways). Idempotent: does nothing when all three are already on PATH. The packages'
# system services are not used: tests start their own servers on free ports.
#   deploy/prometheus/install.sh     prints the prometheus binary's path on stdout
set -euo pipefail
have_all() {
  command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    && command -v prometheus-alertmanager >/dev/null 2>&1
}
if ! have_all; then
  if [ "$(id -u)" -ne 0 ]; then
    sudo=sudo
  else
    sudo=
  fi
  echo "prometheus: installing prometheus and prometheus-alertmanager from the Debian archive" >&2
  $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
    prometheus prometheus-alertmanager >&2
fi
if ! have_all; then
  echo "prometheus: prometheus, promtool or prometheus-alertmanager is not on PATH after installing them" >&2
  exit 1
fi
command -v prometheus
