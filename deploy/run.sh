#!/usr/bin/env bash
# Sets up specwatch on this machine if needed, then runs it: deploy/run.sh demo
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$here/deploy/bootstrap.sh")
exec "$venv/bin/specwatch" "$@"
