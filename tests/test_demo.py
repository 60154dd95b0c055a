"""`specwatch demo` end to end: incidents caught, archive readable after restart, picture written."""

import json
import os
from functools import partial

import pytest

from specwatch.commands.demo import run_simulated_demo

from machine import specwatch, specwatch_ok

_specwatch = partial(specwatch_ok, timeout=900)


def test_demo_catches_each_incident_and_archives_it(tmp_path):
    outdir = tmp_path / "demo"
    # its own archive: the default one is shared by every test of this test process
    proc = _specwatch("demo", "--json", "--outdir", str(outdir), "--archive", f"chdb://{outdir / 'archive'}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    _assert_own_decisions(summary)
    assert summary["counters"]["rejected"] == 0 and summary["counters"]["emitter_dropped"] == 0
    assert (outdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the human report went to stderr, the JSON object alone to stdout
    assert "caught as" in proc.stderr and "error_rate on extraction/main" in proc.stderr

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


# Each incident's own decision: its reason, on the scope it hurts. The error burst hits
# speculative extraction requests of every cohort; main, the busiest, is decided first. It
# may be decided when the fleet-wide KV fallback ends its evidence (a last look), and is then
# recorded beside that fallback with its own reason.
_OWN_DECISIONS = {
    "acceptance_drop": ("acceptance_drop", "coding", {"main", "canary"}),
    "quality_mismatch": ("quality_regression", "structured", {None}),
    "latency_tail": ("latency_slo", "reasoning", {"main"}),
    "error_burst": ("error_rate", "extraction", {"main"}),
    "kv_pressure": ("kv_pressure", None, {None}),
}


def _assert_own_decisions(summary):
    caught = {row["incident"]: row for row in summary["incidents"]}
    assert set(caught) == set(_OWN_DECISIONS)
    for name, (reason, bucket, cohorts) in _OWN_DECISIONS.items():
        row = caught[name]
        assert row["verdict"] == "right", row
        assert (row["reason"], row["decision_bucket"]) == (reason, bucket), row
        assert row["decision_cohort"] in cohorts, row
        assert 0 <= row["detection_delay_s"] < 120, row
    for decision in summary["decisions"]:  # every decision's reason is one of the incidents'
        assert decision["reason"] in {reason for reason, _, _ in _OWN_DECISIONS.values()}, decision


@pytest.mark.parametrize("seed", [1])
def test_demo_names_each_incidents_own_decision_on_other_seeds(seed):
    _assert_own_decisions(run_simulated_demo(seed=seed))


@pytest.mark.parametrize("named_by", ["--archive", "SPECWATCH_ARCHIVE"])
def test_the_picture_is_never_written_into_the_archive_the_demo_opens(tmp_path, named_by):
    outdir = tmp_path / "demo"  # the archive named is the output directory itself
    env = {k: v for k, v in os.environ.items() if k != "SPECWATCH_ARCHIVE"}
    argv = ["demo", "--outdir", str(outdir), "--minutes", "0.2", "--workers", "2"]
    if named_by == "--archive":
        argv += ["--archive", f"chdb://{outdir}"]
    else:
        env["SPECWATCH_ARCHIVE"] = f"chdb://{outdir}"
    done = specwatch(*argv, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr == (f"specwatch demo: the output {outdir}/timeline.png is inside {outdir}, which this "
                           "command reads; write the output elsewhere\n")
    assert not outdir.exists()  # refused before anything was written


def test_the_output_check_looks_at_the_demos_own_archive_under_outdir(tmp_path):
    """By default the demo's archive is <outdir>/archive, not the default archive of the other
    commands (chdb://specwatch-data/archive): a picture in the latter's directory is no clash."""
    env = {k: v for k, v in os.environ.items() if k != "SPECWATCH_ARCHIVE"}
    outdir = "specwatch-data/archive"  # the other commands' default archive directory, from tmp_path
    done = specwatch("demo", "--json", "--outdir", outdir, "--minutes", "0.2", "--workers", "2", env=env,
                     cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["archive"] == "chdb://specwatch-data/archive/archive"
    assert (tmp_path / outdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
