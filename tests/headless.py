"""Debian's Chromium, headless, for the tests that render specwatch's HTML pages."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def chromium() -> str:
    """The browser's path; fails (never skips) when deploy/browser/install.sh has not run."""
    found = os.environ.get("SPECWATCH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("chromium is not installed: run deploy/browser/install.sh (deploy/test.sh does)")
    return found


def headless(browser: str, profile, *args) -> subprocess.CompletedProcess:
    """One headless run on a fresh profile, with the flags a machine without internet needs."""
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=180)
