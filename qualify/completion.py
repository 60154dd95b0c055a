"""One request's result on one path, as the OpenAI-compatible server returned it: the record Gate 1
judges, built from the response JSON (pure) so recorded responses judge the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Completion", "Path", "completion_from_response"]

Path = Literal["speculative", "standard"]


@dataclass
class Completion:
    """``rounds`` are (drafted, accepted) per speculative step, empty on the standard path or when the
    server gave only a summary; ``error`` is None unless the request failed."""

    request_id: str
    path: Path
    sample: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)
    e2e_ms: float = 0.0
    error: str | None = None


def _rounds(metrics: Any) -> list[tuple[int, int]]:
    """(drafted, accepted) per step from ``metrics.speculative_decoding`` (detailed metrics); the
    summary's totals stand in as one round per step when the steps are not listed."""
    spec = (metrics or {}).get("speculative_decoding") if isinstance(metrics, dict) else None
    if not spec:
        return []
    drafted, accepted = spec.get("per_step_drafted"), spec.get("per_step_accepted")
    if drafted is not None and accepted is not None:
        return [(int(d), int(a)) for d, a in zip(drafted, accepted)]
    steps = int(spec.get("num_spec_steps") or 0)
    if not steps:
        return []
    # Summary only: spread the totals evenly; AL stays exact, per-position counts do not.
    total_drafted, total_accepted = int(spec.get("num_draft_tokens") or 0), int(spec.get("num_accepted_draft_tokens") or 0)
    return [(total_drafted // steps, total_accepted // steps)] * steps


def completion_from_response(request_id: str, path: Path, sample: int, body: dict, e2e_ms: float) -> Completion:
    """A completion from a /v1/completions or /v1/chat/completions response body.

    >>> body = {"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": "length"}],
    ...         "usage": {"prompt_tokens": 3},
    ...         "metrics": {"speculative_decoding": {"per_step_drafted": [3, 3], "per_step_accepted": [2, 0]}}}
    >>> c = completion_from_response("r1", "speculative", 0, body, 12.5)
    >>> c.token_ids, c.rounds, c.finish_reason, c.prompt_tokens
    ([5, 6], [(3, 2), (3, 0)], 'length', 3)
    """
    choices = body.get("choices") or []
    if not choices:
        return Completion(request_id, path, sample, e2e_ms=e2e_ms, error="no choice in the response")
    choice = choices[0]
    message = choice.get("message") or {}
    text = choice.get("text") if "text" in choice else message.get("content") or ""
    return Completion(request_id, path, sample, token_ids=list(choice.get("token_ids") or []), text=text or "",
                      finish_reason=choice.get("finish_reason"),
                      prompt_tokens=int((body.get("usage") or {}).get("prompt_tokens") or 0),
                      rounds=_rounds(body.get("metrics")), e2e_ms=e2e_ms)
