#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests (the postmortem page is checked in a
# real headless browser). Idempotent: does nothing when a chromium is already on PATH.
#   deploy/browser/install.sh        prints the browser's path on stdout
set -euo pipefail
find_browser() {
  command -v chromium 2>/dev/null || command -v chromium-browser 2>/dev/null || true
}
browser=$(find_browser)
if [ -z "$browser" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    sudo=sudo
  else
    sudo=
  fi
  echo "browser: installing chromium from the Debian archive" >&2
  $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends chromium >&2
  browser=$(find_browser)
fi
if [ -z "$browser" ]; then
  echo "browser: chromium is not on PATH after installing it" >&2
  exit 1
fi
echo "$browser"
