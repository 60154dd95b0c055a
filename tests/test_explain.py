"""`specwatch explain`: the postmortem of an archived decision, checked in a real headless browser."""

import re
from functools import partial

import pytest

from headless import rendered

from specwatch.lab.simulation.simulator import Simulator
from specwatch.analysis.postmortem import PLOTS

from machine import specwatch
from telemetry_log import archived_replay

SEED = 11


@pytest.fixture(scope="module")
def archived(tmp_path_factory):
    """A short seeded acceptance-drop run archived to chDB: (dsn, decisions)."""
    path = tmp_path_factory.mktemp("archive") / "archive"
    dsn = f"chdb://{path}"
    sim = Simulator("acceptance_drop", seed=SEED, minutes=2.2, workers=2, incident_at=90.0)
    decisions = archived_replay(sim.records(), dsn)
    assert [(d.action, d.reason, d.bucket) for d in decisions][:2] == [
        ("reduce_draft_length", "acceptance_drop", "coding"), ("disable_speculation", "acceptance_drop", "coding")]
    return dsn, decisions


# A separate process: chDB hosts one archive per process, and the CLI is what users run.
_explain = partial(specwatch, "explain")


def test_text_summary_names_decision_thresholds_baseline_and_samples(archived):
    dsn, decisions = archived
    decision = decisions[0]
    proc = _explain(decision.id, "--archive", dsn)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"decision {decision.id}: draft length lowered on {decision.bundle_id}/coding/main")
    assert f"acceptance_length {decision.evidence['value']:.4g} against threshold " \
           f"{decision.evidence['threshold']:.4g}" in out
    assert "detector: acceptance_gate" in out
    assert "thresholds: actions.alert_repeat_seconds=600" in out and "tolerance=0.15" in out
    assert re.search(r"^baseline: .*acceptance_length=\d", out, re.M)
    assert re.search(r"^evidence window: \d+ slices", out, re.M)
    assert "bundle card: drafter.draft_length=4 drafter.mechanism=eagle3" in out
    assert re.search(r"^samples: [1-9]\d*$", out, re.M)


@pytest.mark.browser
def test_postmortem_page_renders_in_a_headless_browser(archived, tmp_path):
    dsn, decisions = archived
    decision = decisions[0]
    page = tmp_path / "postmortem.html"
    proc = _explain(decision.id, "--archive", dsn, "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    dom = rendered(page, tmp_path / "profile", 2400)  # and it paints: a screenshot of the page is a real picture
    assert f'<span id="decision-id">{decision.id}</span>' in dom
    assert f'data-decision-id="{decision.id}"' in dom and 'data-reason="acceptance_drop"' in dom
    assert re.search(r'<td id="field-reason">acceptance_drop</td>', dom)
    assert re.search(r'<td id="field-detector">acceptance_gate</td>', dom)
    # the thresholds that fired: the crossed value and the gate's policy settings
    assert f'<tr data-key="threshold"><th>threshold</th><td>{decision.evidence["threshold"]:.4g}</td></tr>' in dom
    assert '<tr data-key="tolerance"><th>tolerance</th><td>0.15</td></tr>' in dom
    assert '<tr data-key="acceptance_length"><th>acceptance_length</th>' in dom  # the baseline table
    # every evidence plot is an inline SVG the browser parsed; AL has data and its threshold line
    for ident, _, _, _ in PLOTS:
        assert f'<svg id="plot-{ident}"' in dom
    al_plot = re.search(r'<svg id="plot-acceptance_length".*?</svg>', dom, re.S).group(0)
    assert 'id="series-AL"' in al_plot
    assert 'id="reference-threshold"' in al_plot and 'id="reference-baseline"' in al_plot
    assert f'threshold {decision.evidence["threshold"]:.4g}<' in al_plot  # the legend names the value
    assert re.search(r'<svg id="plot-e2e_latency".*?id="series-p99"', dom, re.S)
    # the bundle card and the archived samples
    assert '<tr data-key="drafter.mechanism"><th>drafter.mechanism</th><td>eagle3</td></tr>' in dom
    assert dom.count("<tr data-sample-id=") >= 1


def test_a_fallbacks_postmortem_lists_the_keys_it_covered_while_their_tests_held_evidence(tmp_path):
    # closed loop, 2 x 8: a reasoning tail, a KV surge and an extraction burst start together at
    # 300 s. The KV fallback switches the bundle off 40 s in while the burst's error test holds
    # 5.6 nats, more than half the 8.2 its last look needs: the text and the page both name it.
    from specwatch.actions.flags import FlagStore
    from specwatch.lab.evaluation.overlap import OverlapRun

    run = OverlapRun(127, ("latency_tail", "kv_pressure", "error_burst"), "together", True, 2, 8)
    flags = FlagStore()
    dsn = f"chdb://{tmp_path / 'archive'}"
    sim = Simulator("healthy", seed=run.seed, minutes=6.0, workers=2, concurrency=8, flags=flags,
                    incident_at=300.0, plans=run.plans())
    decisions = archived_replay(sim.records(), dsn, flags=flags)
    kv, = [d for d in decisions if d.reason == "kv_pressure" and d.action == "disable_speculation"]
    scope = f"{kv.bundle_id}/extraction/main"
    evidence = "5.60 nats (last look 8.19, usual 15.10)"

    proc = _explain(kv.id, "--archive", dsn)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("switched off while their own tests held evidence (short of a last look):")
    assert lines[at + 1] == f"  {scope}  error_rate  {evidence}: 2 of 21 requests"
    assert not lines[at + 2].startswith("  ")  # the tail's 4.7 nats are under half of its 11.2: not listed

    page = tmp_path / "postmortem.html"
    proc = _explain(kv.id, "--archive", dsn, "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    table = re.search(r'<table id="covered">.*?</table>', page.read_text(), re.S).group(0)
    assert re.findall(r"<tr data-scope=", table) == ["<tr data-scope="]
    assert (f'<tr data-scope="{scope}" data-gate="error_rate"><td>{scope}</td><td>error_rate</td>'
            f"<td>{evidence}</td><td>2 of 21 requests</td></tr>") in table
