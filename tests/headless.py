"""Debian's Chromium, headless, for the tests that render specwatch's HTML pages."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def rendered(page, profile, height: int) -> str:
    """The DOM of ``page`` as the browser built it; its 1200 x ``height`` screenshot is checked."""
    browser = (os.environ.get("SPECWATCH_CHROMIUM") or shutil.which("chromium")
               or shutil.which("chromium-browser"))
    if not browser:  # fails, never skips
        pytest.fail("chromium is not installed: run deploy/browser/install.sh (deploy/test.sh does)")

    def headless(*args) -> subprocess.CompletedProcess:
        # a fresh profile, and the flags a machine without internet needs
        return subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=180)

    proc = headless("--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr
    shot = page.with_suffix(".png")
    painted = headless(f"--screenshot={shot}", f"--window-size=1200,{height}", page.as_uri())
    assert painted.returncode == 0, painted.stderr
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    return proc.stdout
