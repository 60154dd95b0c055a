"""Running a test module's vLLM scenario in a subprocess and reading back its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest


def run_scenario(script: str, out_dir, timeout_s: float) -> dict:
    """Run ``python script OUT`` (the module's ``__main__``) and return OUT's JSON with ``wall_s``.

    The collector's Python sink and flags must share a process with vLLM's engine core,
    hence in-process engine cores (no V1 multiprocessing) in a process of its own.
    """
    out = out_dir / "result.json"
    started = time.monotonic()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    if proc.returncode != 0:
        pytest.fail(f"vLLM scenario failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.monotonic() - started
    return result
