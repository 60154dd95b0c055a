#!/usr/bin/env bash
# Creates (or refreshes) the Python environment specwatch runs in, from PyPI only.
# Idempotent and cached: a second run with unchanged dependencies takes a second.
#   deploy/bootstrap.sh [--with-vllm]     prints nothing but progress on stderr
# The environment lives at $SPECWATCH_VENV (default ~/.cache/specwatch/venv).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SPECWATCH_VENV:-$HOME/.cache/specwatch/venv}
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    *) echo "bootstrap: unknown argument $arg" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi
stamp="$venv/.specwatch-deps"
want=$(sha256sum "$here/pyproject.toml" | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing specwatch and its dependencies" >&2
  "$venv/bin/python" -m pip install -q -e "$here[test]" >&2
  echo "$want" > "$stamp"
else
  # dependencies unchanged: only point the editable install at this checkout
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" >&2 2>/dev/null \
    || "$venv/bin/python" -m pip install -q --no-deps -e "$here" >&2
fi
if [ "$with_vllm" = 1 ]; then
  "$here/deploy/vllm/install.sh" "$venv" >&2
fi
echo "$venv"
