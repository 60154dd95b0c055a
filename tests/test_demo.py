"""`specwatch demo` end to end: incidents caught, archive readable after restart, picture written."""

import json
from functools import partial

from machine import specwatch_ok

_specwatch = partial(specwatch_ok, timeout=900)


def test_demo_catches_each_incident_and_archives_it(tmp_path):
    outdir = tmp_path / "demo"
    proc = _specwatch("demo", "--json", "--outdir", str(outdir))
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    caught = {row["incident"]: row for row in summary["incidents"]}
    assert set(caught) == {"acceptance_drop", "quality_mismatch", "latency_tail", "error_burst", "kv_pressure"}
    for name, row in caught.items():
        assert row["decision_id"] is not None, f"{name} was not caught"
        assert 0 <= row["detection_delay_s"] < 120, row
    assert summary["counters"]["rejected"] == 0 and summary["counters"]["emitter_dropped"] == 0
    assert (outdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the human report went to stderr, the JSON object alone to stdout
    assert "caught as" in proc.stderr

    # a new process reads the same decisions, their audit and samples back from the archive
    archive = summary["archive"]
    listed = _specwatch("query", "decisions", "--archive", archive, "--json").stdout.strip().splitlines()
    assert [json.loads(line)["decision_id"] for line in listed] == summary["decision_ids"]
    first = summary["decision_ids"][0]
    detail = json.loads(_specwatch("query", "decision", first, "--archive", archive, "--json").stdout)
    assert detail["decision_id"] == first
    assert detail["audit"]["window"] and detail["audit"]["baseline"]["acceptance_length"] > 1
    samples = _specwatch("query", "samples", first, "--archive", archive, "--json").stdout.strip().splitlines()
    assert samples and all(json.loads(line)["decision_id"] == first for line in samples)
