"""`specwatch demo --engine vllm` end to end: the detectors switch the random drafter off
everywhere and leave the copy drafter on, on a real engine through the embedded pipeline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from specwatch.lab.demo.vllm_demo import vllm_demo_policy

from machine import specwatch
from vllm_scenario import contract_records

pytestmark = pytest.mark.vllm

_SUBPROCESS_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    outdir = tmp_path_factory.mktemp("vllm-demo")
    started = time.monotonic()
    # its own archive: the default one is shared by every test of this test process
    proc = specwatch("demo", "--engine", "vllm", "--json", "--outdir", str(outdir),
                     "--archive", f"chdb://{outdir / 'archive'}", timeout=_SUBPROCESS_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"specwatch demo --engine vllm failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["wall_s"] = time.monotonic() - started
    summary["stderr"] = proc.stderr
    return summary


def _phase(demo, name):
    (phase,) = [p for p in demo["phases"] if p["name"] == name]
    return phase


def _records(demo):
    lines = Path(demo["telemetry"]).read_text().splitlines()
    return lines, contract_records(lines)


def _steps(demo, bundle_id):
    return [r for r in _records(demo)[1] if r.kind == "step" and r.bundle_id == bundle_id]


def test_pipeline_decides(demo):
    assert demo["decided_by"] == "pipeline"
    assert demo["counters"]["records"] == demo["records"] > 0
    assert demo["counters"]["rejected"] == 0
    assert demo["counters"]["decisions"] == len(demo["decisions"])


def test_decisions_and_window_stats_are_archived(demo):
    from specwatch.archive.store import Archive

    with Archive.open(demo["archive"], create=False) as archive:
        archived = archive.decisions(limit=None)
        assert sorted(r["decision_id"] for r in archived) == sorted(demo["decision_ids"])
        assert archive.timeline(), "window stats were archived"


def _lowered_to(decisions, scope: str) -> int:
    """The D a scope's reduce_draft_length must name for a drafter that accepts nothing.

    Every predicted acceptance length is 1, so the shortest draft costs least: D 1 once the
    evidence suffices for a curve; a halving (4 to 2) while it is thin, and the evidence says which.
    """
    (lowered,) = [d for _, d in decisions if f"{d['bucket']}/{d['cohort']}" == scope
                  and d["action"] == "reduce_draft_length"]
    basis = lowered["evidence"]["draft_length_basis"]
    assert basis == "best_predicted_speedup" or basis.startswith("halving: "), basis
    return 1 if basis == "best_predicted_speedup" else 2


def test_random_drafter_first_cut_then_disabled_in_every_scope(demo, capsys):
    phase = _phase(demo, "random-drafter")
    policy = vllm_demo_policy()
    mine = [(i, d) for i, d in zip(demo["decision_ids"], demo["decisions"])
            if d["bundle_id"] == phase["bundle_id"] and d["action"] != "alert"]
    assert phase["acceptance"] == 0.0 and phase["drafted"] > 0
    assert len(phase["scopes"]) == 6
    # the fallback table's order for an acceptance collapse: lower D, then, no better, disable
    by_scope = {}
    for _, d in mine:
        by_scope.setdefault(f"{d['bucket']}/{d['cohort']}", []).append(
            (d["action"], d["reason"], d["detector"], d["evidence"].get("draft_length")))
    assert sorted(by_scope) == phase["scopes"]
    for scope, actions in by_scope.items():
        assert actions == [("reduce_draft_length", "acceptance_drop", "acceptance_gate", _lowered_to(mine, scope)),
                           ("disable_speculation", "acceptance_drop", "acceptance_gate", None)], scope
    pinned = policy.baseline.pinned["coding"].acceptance_length
    for _, d in mine:
        assert d["evidence"]["metric"] == "acceptance_length"
        assert d["evidence"]["value"] == 1.0
        assert d["evidence"]["baseline"] == pinned
        assert d["evidence"]["threshold"] == pytest.approx(pinned * (1 - policy.acceptance.tolerance))
    assert [a["decision_id"] for a in phase["actions"]] == [i for i, _ in mine]
    disables = [a for a in phase["actions"] if a["action"] == "disable_speculation"]
    with capsys.disabled():
        first = min(a["after_event_seconds"] for a in phase["actions"])
        last = max(a["after_event_seconds"] for a in disables)
        print(f"\n[vllm demo] random drafter: acceptance 0/{phase['drafted']}, estimated speedup "
              f"{phase['estimated_speedup']}; D cut to 2 from {first:.1f} s, {len(disables)} scopes disabled "
              f"by {last:.1f} s after its first step ({max(a['after_steps'] for a in disables)} steps); TPOT "
              f"{phase['tpot_ms_speculative']} ms speculative, {phase['tpot_ms_standard']} ms after fallback; "
              f"demo {demo['seconds']} s, test {demo['wall_s']:.0f} s")


def test_copy_drafter_keeps_speculating(demo, capsys):
    phase = _phase(demo, "copy-drafter")
    changes = [d for d in demo["decisions"] if d["bundle_id"] == phase["bundle_id"] and d["action"] != "alert"]
    assert changes == []
    assert phase["actions"] == []
    assert phase["acceptance"] == 1.0
    steps = _steps(demo, phase["bundle_id"])
    assert any(e.drafted for e in steps[-1].requests), "drafting to the end"
    # every scope served enough for the acceptance gate to judge it as often as it needed to
    # act on the random drafter's scopes
    policy = vllm_demo_policy()
    judged = policy.acceptance.consecutive
    assert phase["waves"] >= 12
    assert phase["event_seconds"] >= policy.acceptance.window_slices * judged * policy.windows.slice_seconds
    assert min(phase["scope_rounds"].values()) >= policy.acceptance.min_rounds * judged
    assert min(phase["scope_requests"].values()) >= policy.acceptance.min_requests * judged
    with capsys.disabled():
        print(f"\n[vllm demo] copy drafter: {phase['waves']} waves, acceptance {phase['accepted']}/"
              f"{phase['drafted']} over {phase['steps']} steps in {phase['event_seconds']:.1f} s, estimated speedup "
              f"{phase['estimated_speedup']}, TPOT {phase['tpot_ms_speculative']} ms; no decision")


def test_engine_follows_each_decision(demo):
    phase = _phase(demo, "random-drafter")
    steps = _steps(demo, phase["bundle_id"])
    for action in phase["actions"]:
        bucket, cohort = action["scope"].split("/")
        # the phase serves waves until its last decision has steps under it, so every one has
        assert action["in_flight_step"] is not None, action
        # the step in flight may have proposed before the flag flipped, the next verifies that
        later = [e for s in steps if s.seq > action["in_flight_step"] + 1 for e in s.requests
                 if (e.bucket, e.cohort) == (bucket, cohort)]
        earlier = [e for s in steps if s.seq <= action["in_flight_step"] for e in s.requests
                   if (e.bucket, e.cohort) == (bucket, cohort)]
        assert any(e.drafted == 4 for e in earlier)
        # a lower D that the same scope's disable overtook in the step it reached the engine (a
        # loaded machine delivers both at once) has no step of its own: the disable is judged
        superseded = [a["in_flight_step"] for a in phase["actions"] if a is not action
                      and a["scope"] == action["scope"] and a["action"] != "reduce_draft_length"
                      and a["in_flight_step"] <= action["in_flight_step"] + 1]
        if action["action"] == "reduce_draft_length" and superseded:
            assert action["steps_after"] == action["entries_after"] == 0, action
            continue
        assert action["steps_after"] > 0 and action["entries_after"] > 0
        if action["action"] == "reduce_draft_length":
            decided = [d for i, d in zip(demo["decision_ids"], demo["decisions"]) if i == action["decision_id"]]
            assert action["max_drafted_after"] == decided[0]["evidence"]["draft_length"], action
        else:
            assert later and all(e.drafted == 0 for e in later)
            assert action["drafted_after"] == 0 and action["entries_after"] == len(later)
    # with every scope off the drafter no longer runs at all
    last = max(a["in_flight_step"] for a in phase["actions"])
    quiet = [s for s in steps if s.seq > last + 1]
    assert len(quiet) >= 8 and all(s.draft_ms == 0 for s in quiet)
    # and by vLLM's own counters: whole waves served after every scope was off drafted nothing
    assert phase["waves_after_all_off"] >= 1
    assert phase["vllm_draft_tokens_after_all_off"] == 0
    assert demo["fallback_took_effect"] is True


@pytest.mark.parametrize("name", ["copy-drafter", "random-drafter"])
def test_telemetry_totals_equal_vllm_counters(demo, name):
    phase = _phase(demo, name)
    assert phase["vllm_counters"]["draft_tokens"] == phase["drafted"] > 0
    assert phase["vllm_counters"]["accepted_tokens"] == phase["accepted"]


def test_replayed_telemetry_gives_the_same_decisions(demo):
    from specwatch.streams.embedded import EmbeddedPipeline

    pipeline = EmbeddedPipeline(vllm_demo_policy())
    for line in _records(demo)[0]:
        pipeline.feed_line(line)
    pipeline.finish()
    assert [d.id for d in pipeline.decisions] == demo["decision_ids"]


def test_greedy_text_unchanged_and_collector_clean(demo):
    assert demo["lossless"] is True
    assert demo["collector"]["dropped"] == demo["collector"]["hook_errors"] == 0
    assert demo["collector"]["untimed_steps"] == 0
