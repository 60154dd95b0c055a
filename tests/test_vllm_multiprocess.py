"""The collector as production runs it: vLLM's own engine and worker processes, set up by env.

The entry point loads the hooks; sink and flags come from SPECWATCH_VLLM_* variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_scenario import PROMPTS, contract_records, engine_env, ngram_llm_and_params

pytestmark = pytest.mark.vllm

_RECORDS_ENV = "SPECWATCH_TEST_RECORDS"
_MAX_TOKENS = 32
_SUBPROCESS_TIMEOUT_S = 900


class FileSink:
    """Appends each record as a JSON line (built in vLLM's engine process from the env)."""

    def __init__(self) -> None:
        self._file = open(os.environ[_RECORDS_ENV], "a")

    def emit(self, record) -> None:
        self._file.write(record.model_dump_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class NoCodingFlags:
    """A flag view with speculation off for the coding bucket (read in vLLM's worker process)."""

    def lookup(self, bundle_id, bucket, cohort):
        from specwatch.actions.flags import SpeculationState

        return SpeculationState(enabled=bucket != "coding")


def _scenario(out_dir: Path) -> None:
    """Runs in the subprocess: the plain vLLM LLM API, nothing from specwatch passed in."""
    llm, params = ngram_llm_and_params(_MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    (out_dir / "texts.json").write_text(json.dumps([o.outputs[0].text for o in outputs]))
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp("vllm-mp")
    here = str(Path(__file__).resolve().parent)
    env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.update({
        "SPECWATCH_VLLM_SINK": "test_vllm_multiprocess:FileSink",
        "SPECWATCH_VLLM_FLAGS": "test_vllm_multiprocess:NoCodingFlags",
        "SPECWATCH_VLLM_WORKER": "mp-worker",
        _RECORDS_ENV: str(out / "records.jsonl"),
        "PYTHONPATH": os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p),
    })
    started = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True,
                          timeout=_SUBPROCESS_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        pytest.fail(f"vLLM scenario failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    decoded = contract_records((out / "records.jsonl").read_text().splitlines())
    print(f"\n[vllm multiprocess] scenario {time.monotonic() - started:.0f} s, {len(decoded)} records")
    return decoded


def test_records_come_from_the_engine_process(records):
    kinds = [r.kind for r in records]
    assert kinds[0] == "bundle" and kinds.count("bundle") == 1
    assert kinds.count("request") == len(PROMPTS)
    assert all(r.worker == "mp-worker" for r in records)


def test_runner_timings_cross_the_process_boundary(records):
    steps = [r for r in records if r.kind == "step"]
    # the model runner lives in a separate worker process: its step frame travels on the
    # pickled ModelRunnerOutput to the scheduler
    assert steps and all(s.verify_ms > 0 for s in steps)
    assert any(s.draft_ms > 0 for s in steps)


def test_flags_apply_in_the_worker_process(records):
    entries = [e for r in records if r.kind == "step" for e in r.requests]
    assert all(e.drafted == 0 for e in entries if e.bucket == "coding")
    assert sum(e.drafted for e in entries if e.bucket == "chat") > 0
    speculative = {r.bucket: r.speculative for r in records if r.kind == "request"}
    assert speculative == {"coding": False, "chat": True}


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
