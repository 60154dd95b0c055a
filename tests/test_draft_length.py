"""Draft length from evidence: per-position acceptance, the step-cost model, the policy's choice of D."""

import math
import statistics

import numpy as np
import pytest

from specwatch.actions.flags import FlagStore
from specwatch.actions.fallback import FallbackPolicy
from specwatch.lab.simulation.simulator import Simulator
from specwatch.detectors.draft_length import PositionSurvival, StepCost, curve_from_slices, draft_length_curve
from specwatch.detectors.monitor import Finding
from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas.policy import Policy

from telemetry_log import replayed

SEED = 11


def _rounds(rates, n, seed, draft_length=4):
    """A seeded stream of rounds: position k (from 1) accepted with probability rates[k-1] given k-1."""
    rng = np.random.default_rng(seed)
    out = []
    for u in rng.random((n, draft_length)):
        accepted = 0
        while accepted < draft_length and u[accepted] < rates[accepted]:
            accepted += 1
        out.append((draft_length, accepted))
    return out


def _step_slices(draft_lengths, batches=None, pass_ms=0.6, pass_ms_per_request=0.025, verify_base=7.2,
                 verify_per_token=0.015, draft_per_step=0.0):
    """Per-slice bundle statistics of a serial drafter whose step times are exact linear functions.

    Each step runs D drafter passes costing ``pass_ms + pass_ms_per_request * batch`` each, and
    one verify pass costing ``verify_base + verify_per_token * batch * (1 + D)``.
    """
    out = []
    for d, b in zip(draft_lengths, batches or [16] * len(draft_lengths)):
        s = SliceStats()
        s.steps, s.rounds, s.drafted_tokens = 10, 10 * b, 10 * b * d
        s.draft_ms = 10 * (draft_per_step + d * (pass_ms + pass_ms_per_request * b))
        s.verify_ms = 10 * (verify_base + verify_per_token * b * (1 + d))
        out.append(s)
    return out


def _stats(rounds):
    stats = SliceStats()
    for drafted, accepted in rounds:
        stats.add_round(drafted, accepted)
    return stats


def test_survival_counts_and_predicted_acceptance_length_are_exact_on_a_seeded_stream():
    rounds = _rounds([0.9, 0.8, 0.5, 0.3], 5000, SEED)
    survival = PositionSurvival.from_stats(_stats(rounds))
    for k in range(1, 5):
        reached = sum(1 for _, a in rounds if a >= k)
        assert survival.accepted_at_least[k - 1] == reached
        assert survival.rates()[k - 1] == reached / 5000
    # AL(D') from the counts equals the mean of min(accepted, D') + 1 over the same rounds
    for d in range(1, 5):
        assert survival.acceptance_length(d) == pytest.approx(1 + sum(min(a, d) for _, a in rounds) / 5000, abs=1e-12)
    assert math.isnan(survival.acceptance_length(5))  # nothing drafted there: no prediction


def test_acceptance_interval_covers_the_truth_and_narrows_with_evidence():
    truth = [0.9, 0.8, 0.5, 0.3]
    true_al = [1.0 + sum(math.prod(truth[:k]) for k in range(1, d + 1)) for d in range(5)]
    cost = StepCost.fit(_step_slices([4] * 6), "eagle3")
    widths = []
    for n in (400, 6400):
        survival = PositionSurvival.from_stats(_stats(_rounds(truth, n, SEED + n)))
        curve = draft_length_curve(survival, cost, min_rounds=1)
        for p in curve.points:
            assert p.acceptance_low <= true_al[p.draft_length] <= p.acceptance_high, (n, p)
        widths.append(curve.points[-1].acceptance_high - curve.points[-1].acceptance_low)
    assert widths[1] < widths[0] / 3  # 16x the rounds: about a quarter of the width


def test_step_cost_model_recovers_serial_and_parallel_costs():
    batches = [12, 13, 14, 15, 16, 17, 18, 19]
    serial = StepCost.fit(_step_slices([4, 4, 3, 3, 2, 2, 1, 1], batches, draft_per_step=2.0), "eagle3")
    assert (serial.kind, serial.draft_fit, serial.verify_fit) == ("serial", "huber", "huber")
    batch = sum(batches) / len(batches)
    assert serial.draft_ms(3) == pytest.approx(2.0 + 3 * (0.6 + 0.025 * batch), rel=1e-4)
    # at one D but several batch sizes: the pass cost against the batch, nothing per step
    one_d = StepCost.fit(_step_slices([4] * 8, batches), "eagle3")
    assert (one_d.draft_fit, one_d.draft_per_step) == ("theil_sen", 0.0)
    assert (one_d.draft_intercept, one_d.draft_slope) == (pytest.approx(0.6), pytest.approx(0.025))
    assert serial.verify_ms(3) == pytest.approx(7.2 + 0.015 * batch * 4, rel=1e-4)
    assert serial.standard_ms == pytest.approx(7.2 + 0.015 * batch, rel=1e-4)
    # a parallel drafter drafts a block in one pass: its draft time does not grow with D
    parallel = StepCost.fit(_step_slices([4] * 6), "dflash")
    assert parallel.kind == "parallel" and parallel.draft_ms(1) == parallel.draft_ms(8) == pytest.approx(4.0)
    # one D and one batch size: pass cost is the mean, verify flat (the AL / (1 + rho*D) model)
    fixed = StepCost.fit(_step_slices([4] * 6), "mtp")
    assert (fixed.draft_fit, fixed.verify_fit) == ("mean", "flat")
    assert fixed.draft_ms(2) == pytest.approx(2.0) and fixed.verify_ms(1) == fixed.verify_ms(4)


def _curve(rates, n=4000, slices=None):
    slices = slices or _step_slices([4] * 6)
    return curve_from_slices([_stats(_rounds(rates, n, SEED))], slices, "eagle3")


_FINDING = Finding("acceptance_drop", "acceptance_gate", 300.0, "acceptance_length", 2.0, 2.5, 3.0, 295.0, 300.0)
_SCOPE = ("b-1", "coding", "main")


def test_lowering_d_names_the_best_predicted_d_below_the_current_one():
    # acceptance decays only at the later positions: position 3 and 4 rarely pay their draft cost
    curve = _curve([0.95, 0.9, 0.15, 0.1])
    best_below = curve.best(1, 3).draft_length
    assert best_below == 2 and curve.best().draft_length == 2
    decision = FallbackPolicy(Policy(), FlagStore()).decide(_FINDING, _SCOPE, draft_length=4, curve=curve)
    assert decision.action == "reduce_draft_length"
    assert decision.evidence["draft_length"] == 2 and decision.evidence["previous_draft_length"] == 4
    assert decision.evidence["draft_length_basis"] == "best_predicted_speedup"
    shown = decision.evidence["draft_length_curve"]
    assert [p["d"] for p in shown] == [1, 2, 3, 4]
    assert max(shown[:3], key=lambda p: p["speedup"])["d"] == 2
    gain, (low, high) = decision.evidence["predicted_speedup_gain"], decision.evidence["predicted_speedup_gain_interval"]
    assert 0 < low < gain < high


def test_a_drafter_still_good_at_late_positions_is_lowered_by_one_not_halved():
    curve = _curve([0.95, 0.9, 0.85, 0.3])
    decision = FallbackPolicy(Policy(), FlagStore()).decide(_FINDING, _SCOPE, draft_length=4, curve=curve)
    assert decision.evidence["draft_length"] == 3  # halving would say 2


def test_thin_evidence_falls_back_to_halving_and_says_so():
    curve = _curve([0.95, 0.9, 0.15, 0.1], n=120)
    decision = FallbackPolicy(Policy(), FlagStore()).decide(_FINDING, _SCOPE, draft_length=4, curve=curve)
    assert decision.evidence["draft_length"] == 2
    assert decision.evidence["draft_length_basis"] == "halving: 120 rounds < 200"
    assert "draft_length_curve" not in decision.evidence


def test_without_a_curve_the_table_halves_as_before():
    kv = Finding("kv_pressure", "kv_watermark_gate", 300.0, "kv_peak", 0.95, 0.92, math.nan, 297.0, 300.0)
    decision = FallbackPolicy(Policy(), FlagStore()).decide(kv, ("b-1", None, None), draft_length=4)
    assert decision.evidence["draft_length"] == 2 and "draft_length_basis" not in decision.evidence


# The pinned acceptance-drop scenario of tests/test_scenarios.py: same decisions at the same
# times; each lowered D is the best predicted below 4: 3 for main (halving said 2), 2 for the
# canary (as halving, now on evidence).
EXPECTED_LOWERED = [
    (124.99, "coding", "main", 4, 2),
    (148.99, "coding", "canary", 4, 2),
]


def test_pinned_acceptance_drop_lowers_to_the_best_predicted_d():
    sim = Simulator("acceptance_drop", seed=SEED, workers=4, minutes=4.0, incident_at=120.0)
    pipeline = replayed(sim.records())
    lowered = [d for d in pipeline.decisions if d.action == "reduce_draft_length"]
    assert [(round(d.ts - sim.start_ts, 2), d.bucket, d.cohort, d.evidence["previous_draft_length"],
             d.evidence["draft_length"]) for d in lowered] == EXPECTED_LOWERED
    for d in lowered:
        assert d.evidence["draft_length_basis"] == "best_predicted_speedup"
        below = [p for p in d.evidence["draft_length_curve"] if p["d"] < d.evidence["previous_draft_length"]]
        assert max(below, key=lambda p: (p["speedup"], -p["d"]))["d"] == d.evidence["draft_length"]
        assert d.evidence["step_cost"]["mechanism"] == "eagle3"


def _position_rates(scenario):
    """coding's position rates before and after the incident at 30 s, and draft time growth."""
    sim = Simulator(scenario, seed=SEED, workers=2, minutes=1.0, incident_at=30.0)
    stats = {True: SliceStats(), False: SliceStats()}
    draft_ms = {True: [], False: []}
    for r in sim.records():
        if r.kind != "step":
            continue
        after = r.ts >= sim.start_ts + 30.0
        draft_ms[after].append(r.draft_ms / max(1, max(e.drafted for e in r.requests)))
        for e in r.requests:
            if e.bucket == "coding":
                stats[after].add_round(e.drafted, e.accepted)
    before, after = ([round(x, 2) for x in stats[k].position_rates()] for k in (False, True))
    return before, after, statistics.mean(draft_ms[True]) / statistics.mean(draft_ms[False]), sim


def test_late_acceptance_decay_hits_only_the_later_positions_of_its_bucket():
    before, after, draft, sim = _position_rates("late_acceptance_decay")
    assert after[:2] == pytest.approx(before[:2], abs=0.02)
    # P(accepted >= k) for k >= 3 also loses the factor at every late position passed
    assert after[2] == pytest.approx(before[2] * 0.3, abs=0.03)
    assert after[3] == pytest.approx(before[3] * 0.3 * 0.3, abs=0.02)
    assert draft == pytest.approx(1.0, abs=0.05)
    [incident] = sim.incidents
    assert (incident.kind, incident.bucket) == ("late_acceptance_decay", "coding")


def test_draft_cost_doubles_doubles_draft_time_per_position():
    before, after, draft, _ = _position_rates("draft_cost_doubles")
    assert draft == pytest.approx(2.0, abs=0.1)
    assert after == pytest.approx(before, abs=0.02)


def test_advised_d_reaches_95_percent_of_the_best_within_the_target():
    from specwatch.lab.evaluation.draft_length import CASES, TARGET_SECONDS, run_draft_length

    results = {case.scenario: run_draft_length(case, SEED) for case in CASES}
    assert {name: r["settled_after_s"] for name, r in results.items()} == {
        "draft_cost_doubles": 5.0, "late_acceptance_decay": 15.0, "context_shift": 5.0}
    assert all(r["met"] and r["settled_after_s"] <= TARGET_SECONDS for r in results.values())
    # the best D moved and the advice followed it
    cost = results["draft_cost_doubles"]
    assert cost["best_d_before"]["summarization"]["best_d"] == 3 and cost["final"]["summarization"] == {
        "advised_d": 2, "best_d": 2, "ratio": 1.0}
    shift = results["context_shift"]
    assert shift["best_d_before"]["reasoning"]["best_d"] == 2 and shift["final"]["reasoning"] == {
        "advised_d": 3, "best_d": 3, "ratio": 1.0}
    late = results["late_acceptance_decay"]
    assert late["best_d_before"]["coding"]["best_d"] == 4 and late["final"]["coding"] == {
        "advised_d": 2, "best_d": 2, "ratio": 1.0}


def test_mixed_draft_lengths_whose_few_successes_all_drafted_long_give_a_finite_interval():
    # 5 of 300 rounds accepted two tokens, all in rounds that drafted 6; a position's trials
    # estimated from the share of rounds drafting that far (4.2) would be fewer than its successes
    survival = PositionSurvival((5, 5, 0, 0, 0, 0), (300, 250, 199, 151, 100, 53))
    cost = StepCost.fit(_step_slices([4] * 6, pass_ms=2.0, pass_ms_per_request=0.0), "eagle3")
    curve = draft_length_curve(survival, cost, min_rounds=50)
    decision = FallbackPolicy(Policy(), FlagStore()).decide(_FINDING, _SCOPE, draft_length=6, curve=curve)
    assert (decision.action, decision.evidence["draft_length"]) == ("reduce_draft_length", 1)
    gain, (low, high) = decision.evidence["predicted_speedup_gain"], decision.evidence["predicted_speedup_gain_interval"]
    assert all(math.isfinite(x) for x in (gain, low, high)) and low < gain < high
    assert all(p.acceptance_low <= p.acceptance_length <= p.acceptance_high for p in curve.points)
