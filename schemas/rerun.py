"""What a re-run of archived requests takes and gives: the types `specwatch reproduce` and its engines share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["RerunRequest", "RerunOutcome", "first_divergence"]


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


def first_divergence(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """The first output position (0-based) where two token sequences differ; None if equal.

    >>> first_divergence([1, 2, 3], [1, 2, 3]), first_divergence([1, 2, 3], [1, 5, 3]), first_divergence([1], [1, 2])
    (None, 1, 1)
    """
    for position, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return position
    return None if len(expected) == len(actual) else min(len(expected), len(actual))
