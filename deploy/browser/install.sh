#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests (the postmortem page is checked in a
# real headless browser). Idempotent: does nothing when a chromium is already on PATH.
#   deploy/browser/install.sh        prints the browser's path on stdout
set -euo pipefail
source "$(dirname "$0")/../debian_install.sh"
find_browser() {
  command -v chromium 2>/dev/null || command -v chromium-browser 2>/dev/null || true
}
browser=$(find_browser)
if [ -z "$browser" ]; then
  debian_install browser chromium
  browser=$(find_browser)
fi
if [ -z "$browser" ]; then
  echo "browser: chromium is not on PATH after installing it" >&2
  exit 1
fi
echo "$browser"
