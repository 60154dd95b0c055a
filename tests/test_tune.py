"""`specwatch tune`: the per-bucket draft-length report from an archive, as text, JSON and a browser-checked page."""

import json
import re
from collections import defaultdict
from functools import partial

import pytest

from headless import rendered

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import StepRecord

from machine import specwatch
from telemetry_log import archived_replay

SEED = 11


@pytest.fixture(scope="module")
def archived(tmp_path_factory):
    """A seeded healthy run (open loop, every scope drafts D=4) archived to chDB: (dsn, records)."""
    path = tmp_path_factory.mktemp("tune") / "archive"
    dsn = f"chdb://{path}"
    sim = Simulator("healthy", seed=SEED, minutes=1.5, workers=2)
    records = list(sim.records())
    assert archived_replay(records, dsn) == []
    return dsn, records, sim


# A separate process: chDB hosts one archive per process, and the CLI is what users run.
_tune = partial(specwatch, "tune")


def test_json_curve_matches_the_raw_rounds_and_names_the_best_d(archived, tmp_path):
    dsn, records, sim = archived
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8}))
    proc = _tune("--archive", dsn, "--json", "--model-config", str(config))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bundle_id"] == sim.initial_bundle_id
    assert (report["mechanism"], report["deployed_draft_length"]) == ("eagle3", 4)
    assert (report["heads_per_kv_head"], report["starting_draft_length"]) == (4, 31)
    # survival counts straight from the telemetry: rounds drafting position k, and accepting it
    drafted, accepted = defaultdict(lambda: [0] * 4), defaultdict(lambda: [0] * 4)
    for record in records:
        if isinstance(record, StepRecord):
            for entry in record.requests:
                for k in range(entry.drafted):
                    drafted[entry.bucket][k] += 1
                for k in range(entry.accepted):
                    accepted[entry.bucket][k] += 1
    buckets = {b["bucket"]: b for b in report["buckets"]}
    assert sorted(buckets) == sorted(drafted)
    for name, bucket in buckets.items():
        assert bucket["rounds"] == drafted[name][0]
        assert (bucket["current_d"], bucket["tile_candidates"], bucket["starting_d"]) == (4, [31, 63], 31)
        al = 1.0
        for point, n, a in zip(bucket["curve"], drafted[name], accepted[name]):
            al += a / n
            assert point["acceptance_length"] == pytest.approx(al, rel=1e-5)
            assert point["acceptance_interval"][0] < point["acceptance_length"] < point["acceptance_interval"][1]
            assert point["speedup_interval"][0] < point["speedup"] < point["speedup_interval"][1]
        best = max(bucket["curve"], key=lambda p: (p["speedup"], -p["d"]))
        assert bucket["best_d"] == best["d"]
        gain = best["speedup"] / bucket["curve"][3]["speedup"] - 1
        assert bucket["expected_gain"] == pytest.approx(gain, abs=1e-5)
        # a warning exactly where the best D beats the deployed one beyond the interval
        assert (bucket["warning"] is not None) == (bucket["best_d"] != 4 and bucket["expected_gain_interval"][0] > 0)
    # the hard buckets gain from a shorter draft, the easy ones keep D=4
    assert buckets["structured"]["best_d"] == 4 and buckets["long_context"]["best_d"] < 4


def test_text_report_marks_best_and_current_d(archived):
    dsn, _, _ = archived
    proc = _tune("--archive", dsn, "--heads-per-kv", "8")
    assert proc.returncode == 0, proc.stderr
    assert "starting point 128/G - 1 = 15" in proc.stdout
    assert re.search(r"^structured: best D 4, current D 4", proc.stdout, re.M)
    assert re.search(r"^   4  [\d.]+ \([\d.]+-[\d.]+\)   [\d.]+ \([\d.]+-[\d.]+\) \*<$", proc.stdout, re.M)


@pytest.mark.parametrize("args, message", [
    (["--heads-per-kv", "0"], "--heads-per-kv must be at least 1, got 0"),
    (["--window", "-5"], "--window must be a positive, finite number of seconds, got -5"),
    (["--bundle", "b-nope"], "no bundle 'b-nope' in the archive"),
    (["--archive", "chdb:///nonexistent/archive"], "no archive at chdb:///nonexistent/archive"),
])
def test_bad_arguments_are_one_clear_line(archived, args, message):
    dsn, _, _ = archived
    proc = _tune("--archive", dsn, *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1


def test_bad_model_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 4096}))
    proc = _tune("--archive", f"chdb://{tmp_path / 'nothing'}", "--model-config", str(config))
    assert proc.returncode == 2 and "no num_attention_heads: pass --heads-per-kv G instead" in proc.stderr


@pytest.mark.browser
def test_tune_page_renders_in_a_headless_browser(archived, tmp_path):
    dsn, _, _ = archived
    page = tmp_path / "tune.html"
    proc = _tune("--archive", dsn, "--heads-per-kv", "8", "--html", str(page), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    dom = rendered(page, tmp_path / "profile", 3000)
    assert f'data-bundle-id="{report["bundle_id"]}"' in dom
    for bucket in report["buckets"]:
        section = re.search(rf'<section class="bucket" data-bucket="{bucket["bucket"]}".*?</section>', dom, re.S)
        assert section, bucket["bucket"]
        html = section.group(0)
        assert f'data-best-d="{bucket["best_d"]}" data-current-d="4"' in html
        assert f'<b class="best-d">{bucket["best_d"]}</b>' in html
        assert re.search(r"<svg[^>]*>.*?<path", html, re.S), "the plotted curve is an inline SVG the browser parsed"
        assert html.count("<tr data-d=") == 4
        assert ("class=\"warning\"" in html) == (bucket["warning"] is not None)
