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
# The compiled step walks of the block decoder, OTLP and JSON Lines (native/, imported as
# specwatch_native), where Rust is installed; without them the block decoder takes its
# pure-Python reference path. The wheel is cached by
# a hash of the crate's sources: a second run, or another checkout of the same sources,
# installs it without building.
# A cargo that cannot run (rustup without a default toolchain for this HOME) counts as none,
# and a failed build leaves the reference path in place: the README's commands need only
# Python, Java and Go (tests/test_native_decoder.py fails where cargo runs and the walk is missing).
cargo=$(command -v cargo || true)
[ -z "$cargo" ] && [ -x "$HOME/.cargo/bin/cargo" ] && cargo=$HOME/.cargo/bin/cargo
if [ -n "$cargo" ] && ! "$cargo" --version >/dev/null 2>&1; then
  echo "bootstrap: $cargo does not run here (no default Rust toolchain?): the pure-Python step walk runs" >&2
  cargo=
fi
if [ -n "$cargo" ]; then
  cache=$HOME/.cache/specwatch/native
  key=$(cd "$here/native" && cat Cargo.toml Cargo.lock pyproject.toml src/*.rs | sha256sum | cut -c1-16)
  wheels=$cache/wheel-$key
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "bootstrap: building the compiled step walks (native/)" >&2
    "$venv/bin/python" -m pip install -q 'maturin==1.16.0' >&2
    rm -rf "$wheels.partial"
    if PATH="$(dirname "$cargo"):$PATH" CARGO_TARGET_DIR=$cache/target \
      "$venv/bin/maturin" build --release --locked --out "$wheels.partial" -i "$venv/bin/python" \
      -m "$here/native/Cargo.toml" >&2; then
      mv "$wheels.partial" "$wheels"
    else
      echo "bootstrap: the compiled step walk did not build (above): the pure-Python step walk runs" >&2
    fi
  fi
  if ls "$wheels"/*.whl >/dev/null 2>&1 && [ "$(cat "$venv/.specwatch-native" 2>/dev/null)" != "$key" ]; then
    "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheels"/*.whl >&2
    echo "$key" > "$venv/.specwatch-native"
  fi
fi
if [ "$with_vllm" = 1 ]; then
  "$here/deploy/vllm/install.sh" "$venv" >&2
fi
echo "$venv"
