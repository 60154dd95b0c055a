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


def rendered(page, profile, height: int) -> str:
    """The DOM of ``page`` as the browser built it; a screenshot of it (1200 x ``height``) must be a real picture."""
    browser = chromium()
    proc = headless(browser, profile, "--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr
    shot = page.with_suffix(".png")
    painted = headless(browser, profile, f"--screenshot={shot}", f"--window-size=1200,{height}", page.as_uri())
    assert painted.returncode == 0, painted.stderr
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    return proc.stdout
