"""Re-run a decision's sealed requests on an engine passed in; checks, verdicts, audit trail."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from specwatch.schemas import BundleCard, card_differences
from specwatch.schemas.rerun import RerunOutcome, RerunRequest, first_divergence
from specwatch.schemas.sealed import SampleKey, SealedSampleError, open_sealed, sealed_key_id

__all__ = ["REPRODUCED", "NOT_REPRODUCED", "BUNDLE_DIFFERS", "ReproduceError", "Rerunner",
           "position_acceptance", "first_divergence", "reproduce_decision", "render_result"]

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
BUNDLE_DIFFERS = "bundle differs"

# Exit codes of `specwatch reproduce` for each refusal; 0 is a completed run.
EXIT_NOT_FOUND = 1
EXIT_REFUSED = 3


class ReproduceError(Exception):
    """A reproduction that cannot go ahead; ``exit_code`` is what the command returns."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Rerunner(Protocol):
    """A local engine: its fingerprint card first (nothing runs yet), then the re-runs."""

    def card(self) -> BundleCard: ...

    def run(self, requests: Sequence[RerunRequest]) -> list[RerunOutcome]: ...


def position_acceptance(rounds: Sequence[tuple[int, int]], draft_length: int) -> list[float]:
    """Share of rounds that drafted position k and had it accepted, for k = 1..D; ``nan`` where no
    round drafted that far.

    >>> position_acceptance([(4, 2), (4, 0), (2, 2)], 4)
    [0.6666666666666666, 0.6666666666666666, 0.0, 0.0]
    >>> position_acceptance([(0, 0)], 2)
    [nan, nan]
    """
    shares = []
    for k in range(1, draft_length + 1):
        reached = sum(1 for drafted, _ in rounds if drafted >= k)
        accepted = sum(1 for drafted, taken in rounds if drafted >= k and taken >= k)
        shares.append(accepted / reached if reached else math.nan)
    return shares


def compare_request(request: RerunRequest, outcome: RerunOutcome, draft_length: int,
                    bundle_matches: bool) -> dict:
    """One request's report: divergences, per-position acceptance, times and its verdict
    (``bundle differs`` whenever the local engine's card differs: a forced run proves nothing)."""
    speculative_vs_archived = first_divergence(request.output_ids, outcome.speculative_ids)
    verdict = (BUNDLE_DIFFERS if not bundle_matches
               else REPRODUCED if speculative_vs_archived is None else NOT_REPRODUCED)
    return {
        "sample_id": request.sample_id,
        "prompt_tokens": len(request.prompt_ids),
        "output_tokens": len(request.output_ids),
        "sampling": request.sampling,
        "identical": outcome.standard_ids == outcome.speculative_ids,
        "first_divergence": first_divergence(outcome.standard_ids, outcome.speculative_ids),
        "archived_vs_standard": first_divergence(request.output_ids, outcome.standard_ids),
        "archived_vs_speculative": speculative_vs_archived,
        "rounds": len([r for r in outcome.rounds if r[0]]),
        "drafted": sum(d for d, _ in outcome.rounds),
        "accepted": sum(a for _, a in outcome.rounds),
        "position_acceptance": [None if math.isnan(x) else round(x, 4)
                                for x in position_acceptance(outcome.rounds, draft_length)],
        "draft_ms": round(outcome.draft_ms, 3),
        "verify_ms": round(outcome.verify_ms, 3),
        "verdict": verdict,
    }


def reproduce_decision(archive: Any, decision_id: str, key: SampleKey | None, rerunner: Rerunner | None,
                       actor: str, clock: Callable[[], float], force: bool = False,
                       rerunner_for: Callable[[BundleCard], Rerunner] | None = None) -> dict:
    """Open a decision's sealed samples (every attempt audited), check the local engine (built by
    ``rerunner_for(card)`` without ``rerunner``), re-run, archive the result."""
    decision = archive.decision(decision_id)
    if decision is None:
        raise ReproduceError(f"no decision {decision_id!r} in the archive {archive.label}", EXIT_NOT_FOUND)
    sealed = archive.sealed_samples(decision_id)
    if not sealed:
        raise ReproduceError(f"decision {decision_id} has no sealed samples: capture was off when it was "
                             "made (turn on [capture] in the policy for later decisions)", EXIT_NOT_FOUND)
    bundle_id = decision["bundle_id"]

    def audit(outcome: str, **detail: Any) -> None:
        archive.write_sample_opening(decision_id, bundle_id, actor, clock(),
                                     {"outcome": outcome, "key_id": key.key_id if key else None,
                                      "samples": len(sealed), **detail})

    try:
        # every key id first: a wrong key opens nothing at all
        for row in sealed:
            if key is None or sealed_key_id(row["sealed"]) != key.key_id:
                open_sealed(row["sealed"], key, None, None)  # raises with the key ids named
        # a row is the decision's only if the decision names its sample; its ciphertext (sw2)
        # opens only as that sample, so no row's ciphertext can stand in for another's
        listed = set(decision.get("sample_ids") or ())
        foreign = [row["sample_id"] for row in sealed if row["sample_id"] not in listed]
        if foreign:
            raise SealedSampleError(f"sealed sample {foreign[0]!r} is archived under {decision_id} but the "
                                    "decision does not name it among its samples: it belongs to another decision")
        opened = [open_sealed(row["sealed"], key, row["prompt_sha256"] or None, row["output_sha256"] or None,
                              sample_id=row["sample_id"])
                  for row in sealed]
    except SealedSampleError as error:
        audit("refused", error=str(error))
        raise ReproduceError(f"cannot open the samples of {decision_id}: {error}") from None
    audit("opened")
    sampling = {row["sample_id"]: (row["record"].get("sample") or {}).get("sampling") or {}
                for row in archive.samples(decision_id) if row["kind"] == "request"}
    requests = [RerunRequest(row["sample_id"], o.prompt_ids, o.output_ids, sampling.get(row["sample_id"], {}))
                for row, o in zip(sealed, opened)]
    # sw1 samples, sealed before the binding, open by their digests alone: say so in the result
    unbound = [row["sample_id"] for row, o in zip(sealed, opened) if not o.bound]
    card = (decision.get("audit") or {}).get("card")
    if card is None:
        raise ReproduceError(f"decision {decision_id} has no bundle card in its audit row: nothing to check "
                             "the local engine against")
    decision_card = BundleCard.model_validate(card)
    if rerunner is None:
        rerunner = rerunner_for(decision_card)
    differences = card_differences(decision_card, rerunner.card())
    if differences and not force:
        raise ReproduceError(f"the local engine's bundle differs from the decision's in {', '.join(differences)}; "
                             "nothing was run (--force runs anyway, with the verdict 'bundle differs')")
    outcomes = rerunner.run(requests)
    draft_length = decision_card.drafter.draft_length
    reports = [compare_request(r, o, draft_length, not differences) for r, o in zip(requests, outcomes)]
    counts = {v: sum(1 for r in reports if r["verdict"] == v) for v in (REPRODUCED, NOT_REPRODUCED, BUNDLE_DIFFERS)}
    verdict = (BUNDLE_DIFFERS if differences
               else REPRODUCED if counts[REPRODUCED] == len(reports) else NOT_REPRODUCED)
    result = {
        "decision_id": decision_id, "bundle_id": bundle_id, "action": decision["action"],
        "reason": decision["reason"], "key_id": key.key_id, "card_differences": differences,
        "draft_length": draft_length, "verdict": verdict, "counts": counts, "requests": reports,
    }
    if unbound:
        result["unbound_samples"] = unbound
    result["reproduction_id"] = archive.write_reproduction(decision_id, actor, clock(), verdict, result)
    return result


def render_result(result: dict) -> str:
    """The text report of one reproduction, one block per request."""
    lines = [f"decision {result['decision_id']}: {result['action']} ({result['reason']}) on {result['bundle_id']}",
             f"verdict: {result['verdict']}  ({', '.join(f'{n} {v}' for v, n in result['counts'].items() if n)})"]
    if result["card_differences"]:
        lines.append(f"bundle differs in: {', '.join(result['card_differences'])} (run forced)")
    for r in result["requests"]:
        same = ("identical on both paths" if r["identical"]
                else f"speculative differs from standard from token {r['first_divergence']}")
        acceptance = " ".join("-" if x is None else f"{x:.2f}" for x in r["position_acceptance"])
        archived = ("matches the archived output" if r["archived_vs_speculative"] is None
                    else f"leaves the archived output at token {r['archived_vs_speculative']}")
        lines.append(f"  {r['sample_id']}: {r['verdict']}; {r['prompt_tokens']} prompt / {r['output_tokens']} "
                     f"output tokens; {same}; the speculative re-run {archived}")
        lines.append(f"    acceptance by position [{acceptance}] ({r['accepted']}/{r['drafted']} in "
                     f"{r['rounds']} rounds); draft {r['draft_ms']:.1f} ms, verify {r['verify_ms']:.1f} ms")
    lines.append(f"archived as {result['reproduction_id']}")
    return "\n".join(lines)
