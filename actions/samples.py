"""The samples archived with a decision: the records that show its finding, then healthy controls
of the same scope, each with why it was chosen (`pick_samples`)."""

from __future__ import annotations

from specwatch.schemas.slice_stats import sample_record
from specwatch.schemas.reasons import facts_of

__all__ = ["pick_samples", "sample_id"]

# The records that show the problem, then healthy controls of the same scope.
_PROBLEM_SAMPLES = 9
_CONTROL_SAMPLES = 3


def sample_id(sample: dict) -> str:
    if sample.get("kind") == "step":
        return f"{sample['worker']}:{sample['seq']}"
    return str(sample.get("id"))


def _take_unchosen(ranked, limit: int, chosen: dict[str, dict], reasons: dict[str, str]) -> None:
    """Adds up to ``limit`` of the ``(why, sample)`` pairs whose sample is not chosen yet."""
    taken = 0
    for why, sample in ranked:
        if taken == limit:
            break
        ident = sample["_rank"][-1]
        if ident not in chosen:
            chosen[ident] = sample
            reasons[ident] = why
            taken += 1


def _controls(candidates, why: str) -> list[tuple[str, dict]]:
    return [(why, sample) for sample in sorted(candidates, key=lambda s: s["_rank"])]


def pick_samples(reason: str, candidates: dict[str, list[dict]]) -> tuple[list[dict], dict[str, str]]:
    """The samples that show a finding, then healthy controls; and why each was chosen."""
    facts = facts_of(reason)
    problems, control = facts.problem_samples, facts.control_samples
    chosen: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    ranked = sorted(((index, sample) for index, kind in enumerate(problems) for sample in candidates.get(kind, ())),
                    key=lambda pair: (pair[0], pair[1]["_rank"]))
    _take_unchosen([(problems[index], sample) for index, sample in ranked], _PROBLEM_SAMPLES,
                   chosen, reasons)
    if facts.served_requests:
        served = _controls(candidates.get("control_request", ()), "served_request")
        _take_unchosen(served, _CONTROL_SAMPLES, chosen, reasons)
    controls = _controls(candidates.get(control, ()), "control")
    _take_unchosen(controls, _CONTROL_SAMPLES, chosen, reasons)
    return [sample_record(s) for s in chosen.values()], reasons
