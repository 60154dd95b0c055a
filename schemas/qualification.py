"""A bundle's qualification report: Gate 1 (quality invariants), Gate 2 (the end-to-end ledger)
and the draft-length sweep, bound to the card's fingerprint; archived, read by admission."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .contract import BundleCard, Name, bundle_digest

__all__ = ["QUALIFICATION_VERSION", "GateResult", "Qualification", "Verdict"]

QUALIFICATION_VERSION = 1
"""Bumped when a field changes meaning; an archived report of another version is read as-is."""

Verdict = Literal["pass", "fail", "not_run"]


class GateResult(BaseModel):
    """One gate's verdict, every reason it failed (named, with its scope) and its measurements."""

    model_config = ConfigDict(extra="forbid")

    verdict: Verdict
    reasons: list[str] = Field(default_factory=list, description="why it failed, one line per finding")
    detail: dict[str, Any] = Field(default_factory=dict)


class Qualification(BaseModel):
    """The report `specwatch qualify` archives under ``bundle_id`` (the card's digest): it proves
    nothing about any other card, so a changed card has no qualification until it is run again.

    >>> from specwatch.schemas import DrafterCard, TargetCard
    >>> card = BundleCard(target=TargetCard(model_id="m"), drafter=DrafterCard(mechanism="ngram", draft_length=2))
    >>> q = Qualification.for_card(card, ts=1.0, gate1=GateResult(verdict="pass"),
    ...                            gate2=GateResult(verdict="fail", reasons=["c=1: no faster"]))
    >>> q.bundle_id == bundle_digest(card), q.verdict, q.passed
    (True, 'fail', False)
    """

    model_config = ConfigDict(extra="forbid")

    v: int = QUALIFICATION_VERSION
    bundle_id: Name
    card: BundleCard
    ts: float = Field(ge=0, description="unix seconds the run finished")
    verdict: Verdict
    gate1: GateResult
    gate2: GateResult
    sweep: dict[str, Any] = Field(default_factory=dict, description="D and mechanism candidates, Pareto front, "
                                                                    "Dynamic SD table")
    dataset: dict[str, Any] = Field(default_factory=dict, description="name, digest, requests per bucket")
    cost: dict[str, Any] = Field(default_factory=dict, description="engine starts, requests, wall seconds")

    @classmethod
    def for_card(cls, card: BundleCard, *, ts: float, gate1: GateResult, gate2: GateResult,
                 **fields: Any) -> "Qualification":
        """The report of ``card``: it passes only when both gates pass (a gate not run fails it)."""
        verdict = "pass" if gate1.verdict == gate2.verdict == "pass" else "fail"
        return cls(bundle_id=bundle_digest(card), card=card, ts=ts, verdict=verdict, gate1=gate1, gate2=gate2,
                   **fields)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def reasons(self) -> list[str]:
        """Every failing finding, gate by gate."""
        return ([f"gate 1: {r}" for r in self.gate1.reasons] + [f"gate 2: {r}" for r in self.gate2.reasons])
