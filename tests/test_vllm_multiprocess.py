"""The collector as production runs it, in vLLM's own engine and worker processes: the entry point
loads the hooks; sink and flags come from SPECWATCH_VLLM_* variables."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from vllm_scenario import PROMPTS, contract_records, ngram_llm_and_params, scenario_fixture

pytestmark = pytest.mark.vllm

_RECORDS_ENV = "SPECWATCH_TEST_RECORDS"
_MAX_TOKENS = 32


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


def _scenario(out_path: Path) -> None:
    """Runs in the subprocess: the plain vLLM LLM API, nothing from specwatch passed in."""
    records = out_path.with_name("records.jsonl")
    os.environ[_RECORDS_ENV] = str(records)  # where the engine process's FileSink writes
    llm, params = ngram_llm_and_params(_MAX_TOKENS)
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    out_path.write_text(json.dumps({"records": records.read_text().splitlines()}))


_HERE = str(Path(__file__).resolve().parent)
run = scenario_fixture(
    __file__, multiprocessing=True, SPECWATCH_VLLM_SINK="test_vllm_multiprocess:FileSink",
    SPECWATCH_VLLM_FLAGS="test_vllm_multiprocess:NoCodingFlags", SPECWATCH_VLLM_WORKER="mp-worker",
    PYTHONPATH=os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH")) if p))


@pytest.fixture(scope="module")
def records(run) -> list:
    decoded = contract_records(run["records"])
    print(f"\n[vllm multiprocess] scenario {run['wall_s']:.0f} s, {len(decoded)} records")
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
