#!/usr/bin/env bash
# Builds the OpenTelemetry Collector that specwatch's deployment and tests use (otlp and kafka
# receivers, batch processor, kafka and file exporters) from the Go module proxy, once per
# machine: the binary is cached under ~/.cache/specwatch/otelcol/<version>/ and a second run is
# a fast no-op. Prints the binary's path.
#   deploy/otelcol/build.sh
#
# Why a hand-written main.go rather than the Collector builder (ocb): the builder runs
# `go mod tidy`, which fails on a test-only module version the proxy does not serve
# (otlpencodingextension v0.165.1); a plain `go build` never needs it. The first build takes
# about 7.5 minutes and 0.9 GB on 2 cores.
set -euo pipefail

_VERSION=0.165.0

here=$(cd "$(dirname "$0")" && pwd)
cache=${SPECWATCH_OTELCOL_CACHE:-$HOME/.cache/specwatch/otelcol}/$_VERSION
binary="$cache/specwatch-otelcol"
stamp="$cache/sources.sha256"
want=$(cat "$here/main.go" "$here/go.mod" | sha256sum | cut -c1-16)
if [ -x "$binary" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$binary"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "otelcol build: no 'go' command on PATH; install Go 1.25 or newer (Debian: golang-go is too old, use the toolchain the machine ships)" >&2
  exit 2
fi

mkdir -p "$cache"
# One build at a time per machine: a second caller waits for the first and then reuses it.
exec 9>"$cache/.lock"
flock 9
if [ -x "$binary" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$binary"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# -mod=mod lets the go command add the indirect requirements to the copy of go.mod in $work,
# so the checked-in go.mod stays the short list of what main.go imports.
cp "$here/main.go" "$here/go.mod" "$work/"
start=$SECONDS
echo "otelcol build: building specwatch-otelcol $_VERSION (about 7.5 minutes the first time)" >&2
(cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -p 2 -trimpath -o "$work/specwatch-otelcol" .) >&2
mv "$work/specwatch-otelcol" "$binary"
echo "$want" > "$stamp"
echo "otelcol build: done in $((SECONDS - start)) s" >&2
echo "$binary"
