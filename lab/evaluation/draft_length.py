"""The draft-length suite: how close the advised D comes to the best D after the best D moves,
scored by the simulator's own cost and acceptance (docs/DRAFT_LENGTH.md)."""

from __future__ import annotations

from dataclasses import dataclass

from specwatch.lab.simulation.engine_model import KV_CAPACITY_TOKENS
from specwatch.lab.simulation.simulator import DEFAULT_CARD, Simulator, true_speedup
from specwatch.schemas import StepRecord
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.analysis.tuning import tune_report

__all__ = ["CASES", "TARGET_RATIO", "TARGET_SECONDS", "DraftLengthCase", "format_draft_length", "run_draft_length"]

# The advice counts as good when its true speedup is at least this share of the best D's,
# in every bucket, from at most this long after the change on.
TARGET_RATIO = 0.95
TARGET_SECONDS = 60.0
_CHANGE_AT = 90.0
MINUTES = 3.5
WORKERS = 4
_EVIDENCE_SECONDS = 30.0
_CHECK_EVERY_SECONDS = 5.0


@dataclass(frozen=True)
class DraftLengthCase:
    """One scenario of the suite and what its change does to the truth."""

    scenario: str
    intensity: float
    draft_factor: float = 1.0
    late_factor: float = 1.0
    late_bucket: str | None = None


CASES = (
    DraftLengthCase("draft_cost_doubles", 2.0, draft_factor=2.0),
    DraftLengthCase("late_acceptance_decay", 0.3, late_factor=0.3, late_bucket="coding"),
    DraftLengthCase("context_shift", 10.0),
)


def _oracle(case: DraftLengthCase, bucket: str, changed: bool, load: tuple[float, float, float]) -> list[float]:
    """True speedup at D = 1..deployed D for one bucket under the fleet's measured load."""
    draft_factor = case.draft_factor if changed else 1.0
    late = case.late_factor if changed and bucket == case.late_bucket else 1.0
    return [true_speedup(bucket, d, *load, draft_factor=draft_factor, late_factor=late)
            for d in range(1, DEFAULT_CARD.drafter.draft_length + 1)]


def run_draft_length(case: DraftLengthCase, seed: int = 11) -> dict:
    """Run one case; per check time, the advised and the best D per bucket and the speedup ratio."""
    sim = Simulator(case.scenario, seed=seed, workers=WORKERS, minutes=MINUTES, incident_at=_CHANGE_AT,
                    intensity=case.intensity)
    rows: list[dict] = []
    pipeline = EmbeddedPipeline(sinks=[lambda output: rows.extend(output.window_rows)])
    steps: list[tuple[float, int, int, float]] = []  # ts, requests, drafting, kv tokens
    for record in sim.records():
        if isinstance(record, StepRecord):
            steps.append((record.ts, len(record.requests), sum(1 for e in record.requests if e.drafted),
                          record.kv_usage * KV_CAPACITY_TOKENS))
        pipeline.feed(record)
    pipeline.finish()
    card = DEFAULT_CARD.model_dump(mode="json")
    change = sim.start_ts + _CHANGE_AT
    checks = []
    t = sim.start_ts + _EVIDENCE_SECONDS + _CHECK_EVERY_SECONDS
    while t <= sim.end_ts - 1.0:
        window = [s for s in steps if t - _EVIDENCE_SECONDS < s[0] <= t]
        load = tuple(sum(s[i] for s in window) / len(window) for i in (1, 2, 3))
        report = tune_report([r for r in rows if r["ts"] <= t], card, sim.initial_bundle_id,
                             window_seconds=_EVIDENCE_SECONDS)
        buckets = {}
        for b in report["buckets"]:
            truth = _oracle(case, b["bucket"], t > change, load)
            best = max(range(len(truth)), key=lambda i: truth[i]) + 1
            advised = b["best_d"]
            # No advice (thin evidence) scores as nothing gained: the check cannot pass on it.
            ratio = round(truth[advised - 1] / truth[best - 1], 4) if advised else 0.0
            buckets[b["bucket"]] = {"advised_d": advised, "best_d": best, "ratio": ratio}
        worst = min((v["ratio"] for v in buckets.values()), default=0.0)
        checks.append({"after_change_s": round(t - change, 1), "worst_ratio": worst, "buckets": buckets})
        t += _CHECK_EVERY_SECONDS
    return _score(case, checks)


def _score(case: DraftLengthCase, checks: list[dict]) -> dict:
    after = [c for c in checks if c["after_change_s"] > 0]
    # the first check from which every later one meets the target
    settled = next((check["after_change_s"] for i, check in enumerate(after)
                    if all(c["worst_ratio"] >= TARGET_RATIO for c in after[i:])), None)
    before = [c for c in checks if c["after_change_s"] <= 0]
    final = after[-1] if after else {"buckets": {}}
    return {
        "scenario": case.scenario,
        "intensity": case.intensity,
        "settled_after_s": settled,
        "met": settled is not None and settled <= TARGET_SECONDS,
        "worst_ratio_before": min((c["worst_ratio"] for c in before), default=None),
        "worst_ratio_settled": min((c["worst_ratio"] for c in after if settled is not None
                                    and c["after_change_s"] >= settled), default=None),
        "best_d_before": before[-1]["buckets"] if before else {},
        "final": final["buckets"],
        "checks": checks,
    }


def format_draft_length(results: list[dict]) -> str:
    """The suite's table: per scenario, when the advice settled within the target and how close it is."""
    lines = [f"\nDraft length: advised D against the best D (true speedup ratio >= {TARGET_RATIO:.0%} in every "
             f"bucket within {TARGET_SECONDS:.0f} s of the change; {_EVIDENCE_SECONDS:.0f} s evidence windows)",
             f"{'scenario':<24}{'settled after':>15}{'worst ratio':>13}  met  best D after (advised)"]
    for r in results:
        settled = "never" if r["settled_after_s"] is None else f"{r['settled_after_s']:.0f} s"
        worst = "-" if r["worst_ratio_settled"] is None else f"{r['worst_ratio_settled']:.3f}"
        moves = ", ".join(f"{b} {v['best_d']}({v['advised_d']})" for b, v in sorted(r["final"].items()))
        lines.append(f"{r['scenario']:<24}{settled:>15}{worst:>13}  {'yes' if r['met'] else 'NO ':<4} {moves}")
    return "\n".join(lines)
