"""Decisions are byte-identical with the compiled walks on and off: `specwatch replay` of JSON Lines
(SPECWATCH_NATIVE=1 and 0) and the OTLP batch mode, on incident scenarios."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specwatch.schemas import native_walks
from specwatch.schemas.codec import encode_record
from specwatch.schemas.otlp import encode_records
from specwatch.schemas.otlp_block import request_block
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline

from test_native_decoder import pytestmark  # noqa: F401  (built wherever cargo is; skipped only without it)

_SEED = 11
# scenario -> the (action, reason, bucket) its decisions must begin with, so that the runs compared decide something
_SCENARIOS = {"acceptance_drop": ("reduce_draft_length", "acceptance_drop", "coding"),
              "draft_regression": ("alert", "draft_overhead", None)}


def _simulated(scenario: str) -> list:
    return list(Simulator(scenario, seed=_SEED, workers=4, minutes=2.5, incident_at=60.0).records())


def test_both_walks_are_loaded():
    assert native_walks.DECODERS == {"jsonl": "native", "otlp": "native"}


@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_replay_decides_the_same_bytes_with_the_compiled_walk_on_and_off(scenario, tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text("".join(encode_record(record) + "\n" for record in _simulated(scenario)))
    outputs = {}
    for native in ("1", "0"):
        out = tmp_path / f"decisions-{native}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "specwatch.cli", "replay", str(telemetry), "--output", str(out)],
                              env={**os.environ, "SPECWATCH_NATIVE": native}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        outputs[native] = out.read_bytes()
    assert outputs["1"] == outputs["0"]
    first = outputs["1"].splitlines()[0].decode()
    action, reason, bucket = _SCENARIOS[scenario]
    assert f'"action":"{action}"' in first and f'"reason":"{reason}"' in first
    assert (f'"bucket":"{bucket}"' if bucket else '"bucket":null') in first


@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_otlp_blocks_decide_the_same_bytes_with_the_compiled_walk_on_and_off(scenario):
    records = _simulated(scenario)
    payloads = [encode_records(records[i:i + 200]) for i in range(0, len(records), 200)]
    decided = {}
    for native in (True, False):
        pipeline = EmbeddedPipeline()
        for payload in payloads:
            pipeline.feed_block(request_block(payload, native))
        decided[native] = [d.to_json_line() for d in pipeline.decisions + pipeline.finish()]
    assert decided[True] == decided[False]
    action, reason, _ = _SCENARIOS[scenario]
    assert decided[True] and f'"action":"{action}"' in decided[True][0] and f'"reason":"{reason}"' in decided[True][0]
