"""Running a test module's vLLM scenario in a subprocess and reading back its result and records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


class ListSink:
    """A collector sink that keeps every record it is given."""

    def __init__(self) -> None:
        self.records: list = []

    def emit(self, record) -> None:
        self.records.append(record)


def contract_records(lines) -> list:
    """The records of JSON ``lines``; every line must be a contract-v1 record."""
    from specwatch.schemas import Rejection, decode_line

    records = [decode_line(line) for line in lines]
    rejected = [r for r in records if isinstance(r, Rejection)]
    assert not rejected, f"records broke contract v1: {rejected[:3]}"
    return records


def engine_env(**settings: str) -> dict[str, str]:
    """This process's environment for an engine process: offline, a small KV cache, ``settings`` on top."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                VLLM_CPU_KVCACHE_SPACE="1", **settings)


def scenario_fixture(script: str, timeout_s: float = 900, name: str = "run",
                     multiprocessing: bool = False, **settings: str):
    """A module-scoped fixture ``name``: the JSON that ``python script OUT`` wrote, with ``wall_s``.

    The process has `engine_env` with ``settings``; without V1 ``multiprocessing`` the engine core
    runs in it, beside the Python sink and flags.
    """
    @pytest.fixture(scope="module", name=name)
    def results(tmp_path_factory) -> dict:
        out = tmp_path_factory.mktemp(Path(script).stem) / "result.json"
        started = time.monotonic()
        env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING=str(int(multiprocessing)), **settings)
        proc = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
        if proc.returncode != 0:
            pytest.fail(f"vLLM scenario failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        result = json.loads(out.read_text())
        result["wall_s"] = time.monotonic() - started
        return result
    return results


def records_of_kind(lines, kind: str) -> list:
    """The contract-v1 records of one kind (step, request, bundle, shadow) among JSON ``lines``."""
    return [r for r in contract_records(lines) if r.kind == kind]


def drafted_rounds(lines) -> list:
    """The round entries that drafted, of every step record among JSON ``lines``."""
    return [e for s in records_of_kind(lines, "step") for e in s.requests if e.drafted]


def rounds_matching_counters(lines, counters: dict) -> list:
    """The drafted rounds among JSON ``lines``, which must add up to vLLM's ``counters`` exactly."""
    rounds = drafted_rounds(lines)
    assert len(rounds) == counters["drafts"]
    assert sum(e.drafted for e in rounds) == counters["draft_tokens"]
    assert sum(e.accepted for e in rounds) == counters["accepted_tokens"]
    # how many rounds accepted at least 1, 2, ... drafts, as vLLM counts per position
    per_position = counters["accepted_per_pos"]
    positions = range(1, len(per_position) + 1)
    assert [sum(1 for e in rounds if e.accepted >= k) for k in positions] == per_position
    return rounds


def measured_run(engine, collector, records: list, requests, on_step=None):
    """`run_to_completion` under ``collector``: the run, and {"records": the JSON lines it added
    to ``records``, "counters": vLLM's speculative decoding counters it gained}."""
    from specwatch.engines.vllm.local_engine import run_to_completion, spec_decode_counters
    from specwatch.schemas import encode_record

    collector.flush()
    first, before = len(records), spec_decode_counters(engine)
    run = run_to_completion(engine, requests, on_step)
    collector.flush()
    after = spec_decode_counters(engine)
    gained = {k: after[k] - before[k] for k in after if k != "accepted_per_pos"}
    previous = before["accepted_per_pos"]
    gained["accepted_per_pos"] = [a - (previous[i] if i < len(previous) else 0)
                                  for i, a in enumerate(after["accepted_per_pos"])]
    return run, {"records": [encode_record(r) for r in records[first:]], "counters": gained}


def flagged_collector(worker: str):
    """A collector on a `ListSink`, obeying a `FlagStore` of its own: collector, records, flags."""
    from specwatch.actions.flags import FlagStore
    from specwatch.collectors.vllm import VllmCollector

    sink, flags = ListSink(), FlagStore()
    return VllmCollector(sink, flags=flags, worker=worker), sink.records, flags


def watched_engine(collector, target, spec, **options):
    """A local engine (`new_engine` with ``options``) built under ``collector``; its bundle id."""
    from specwatch.engines.vllm.local_engine import new_engine

    with collector.watching():
        engine = new_engine(target, spec, **options)
    (bundle_id,) = collector.bundles
    return engine, bundle_id


def flag_decision(bundle_id: str, action: str, bucket=None, cohort=None, **evidence):
    """A decision from detector "test" on an acceptance drop, dated now."""
    from specwatch.schemas import Decision

    return Decision(ts=time.time(), bundle_id=bundle_id, bucket=bucket, cohort=cohort,
                    action=action, reason="acceptance_drop", detector="test", evidence=evidence)


BUCKETS = ["coding", "chat", "coding", "chat"]
PROMPTS = [
    "def parse(line):\n    return line.split(',')\n",
    "import os\nimport sys\n\nfor name in os.listdir('.'):\n",
    "class Cache:\n    def __init__(self):\n        self.items = {}\n",
    "The quick brown fox jumps over the lazy dog.",
]


NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 3}


def ngram_llm_and_params(max_tokens: int):
    """vLLM's plain LLM API on the tiny target with ngram speculation (D=4), and greedy
    sampling parameters for `PROMPTS` labelled with `BUCKETS` (what `vllm serve` sees)."""
    from vllm import LLM, SamplingParams

    from specwatch.lab.demo.tiny_models import build_tiny_models

    models = build_tiny_models()
    llm = LLM(model=str(models.target), dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=8, seed=0, speculative_config=NGRAM_SPEC)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             extra_args={"specwatch_bucket": bucket}) for bucket in BUCKETS]
    return llm, params
