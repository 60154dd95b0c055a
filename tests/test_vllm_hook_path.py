"""The collector's hook path (lab/bench/hook_path.py) replayed on recorded step shapes gives
back exactly those steps; stand-in engine objects in a subprocess, no engine is started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vllm_scenario import NGRAM_SPEC, flag_decision, scenario_fixture

pytestmark = pytest.mark.vllm

_SUBPROCESS_TIMEOUT_S = 600


def _replay(out_path: Path) -> None:
    from specwatch.actions.flags import FlagStore
    from specwatch.lab.bench.hook_path import replay_hook_path
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.engines.vllm.local_engine import configure_cpu_environment, engine_args
    from specwatch.lab.simulation.simulator import Simulator

    configure_cpu_environment()
    config = engine_args(build_tiny_models().target, NGRAM_SPEC).create_engine_config()
    steps = [r for r in Simulator("healthy", seed=17, minutes=0.05, workers=1, concurrency=6).records()
             if r.kind == "step"][:60]
    flags = FlagStore()
    first = replay_hook_path(config, steps, flags=flags, repeat=1)
    bundle_id = first.records[0].bundle_id
    off_bucket = steps[0].requests[0].bucket
    flags.apply(flag_decision(bundle_id, "disable_speculation", off_bucket))
    gated = replay_hook_path(config, steps, flags=flags, repeat=2)
    out_path.write_text(json.dumps({
        "steps": [s.model_dump(mode="json") for s in steps],
        "off_bucket": off_bucket,
        "runs": [{"records": [r.model_dump(mode="json") for r in run.records], "steps": run.steps,
                  "collector_us": run.collector_us, "self_timed_us": run.self_timed_us}
                 for run in (first, gated)],
    }))


replayed = scenario_fixture(__file__, _SUBPROCESS_TIMEOUT_S, name="replayed")


def _rows(step: dict) -> list[tuple]:
    return [(e["id"], e["bucket"], e["cohort"], e["drafted"], e["accepted"]) for e in step["requests"]]


def test_replay_gives_back_every_recorded_step_and_request(replayed):
    recorded = replayed["steps"]
    ids = {e["id"] for s in recorded for e in s["requests"]}
    for run, repeat in zip(replayed["runs"], (1, 2)):
        records = run["records"]
        assert records[0]["kind"] == "bundle" and run["steps"] == len(recorded) * repeat
        steps = [r for r in records if r["kind"] == "step"]
        assert [s["seq"] for s in steps] == list(range(len(recorded) * repeat))
        assert [_rows(s) for s in steps] == [_rows(s) for s in recorded] * repeat
        requests = [r for r in records if r["kind"] == "request"]
        assert sorted(r["id"] for r in requests) == sorted(list(ids) * repeat)


def test_gate_turns_off_exactly_the_disabled_bucket(replayed):
    first, gated = replayed["runs"]
    assert all(r["speculative"] for r in first["records"] if r["kind"] == "request")
    speculative = {(r["bucket"], r["speculative"]) for r in gated["records"] if r["kind"] == "request"}
    off = replayed["off_bucket"]
    assert (off, False) in speculative and (off, True) not in speculative
    assert all(flag for bucket, flag in speculative if bucket != off)


if __name__ == "__main__":
    _replay(Path(sys.argv[1]))
