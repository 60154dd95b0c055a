"""What a re-run of archived requests takes and gives: the types `specwatch reproduce` and its engines share."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RerunRequest", "RerunOutcome"]


@dataclass(frozen=True)
class RerunRequest:
    """One archived request to run again: its opened token ids and sampling settings."""

    sample_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    sampling: dict


@dataclass
class RerunOutcome:
    """One request run twice: the standard-decoding and speculative outputs, and the rounds."""

    standard_ids: list[int]
    speculative_ids: list[int]
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step
    draft_ms: float = 0.0
    verify_ms: float = 0.0
