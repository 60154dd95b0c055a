"""What each decision reason means, in one table: the policy section whose thresholds judged it,
the samples that show it, the fallback it leads to, and whether a restore may undo it."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

__all__ = ["REASONS", "ReasonFacts", "facts_of", "restorable_reasons"]

# The samples a decision keeps when its reason names none of its own: every kind that may
# show a problem, with healthy steps of the same scope as controls.
_ANY_PROBLEM = ("error", "timeout", "lowest_acceptance", "slowest")


@dataclass(frozen=True)
class ReasonFacts:
    """The facts of one decision reason.

    Parameters
    ----------
    section
        The policy file's section whose settings judged it, archived beside the decision (None: none).
    problem_samples
        The sample kinds (`schemas.slice_stats.SAMPLE_KINDS`) that show the problem, best first.
    control_samples
        The healthy samples of the same scope kept beside them.
    fallback
        What the fallback table does: lower D first then disable, disable at once, alert only,
        invalidate the bundle, or what admission decides.
    restorable
        Whether a restore may undo it by default (`actions.restore_reasons`).
    served_requests
        Whether the decision also keeps finished requests of its scope that drafted on the suspect
        path: acceptance is measured on steps, but a request is what `specwatch reproduce` re-runs.
    """

    section: str | None
    problem_samples: tuple[str, ...] = _ANY_PROBLEM
    control_samples: Literal["control_step", "control_request"] = "control_step"
    fallback: Literal["reduce_first", "disable", "alert", "invalidate", "admission"] = "disable"
    restorable: bool = False
    served_requests: bool = False


REASONS: Mapping[str, ReasonFacts] = MappingProxyType({
    "acceptance_drop": ReasonFacts("acceptance", ("lowest_acceptance",), "control_step", "reduce_first",
                                   restorable=True, served_requests=True),
    "no_speedup": ReasonFacts("speedup", ("lowest_acceptance",), "control_step", "disable",
                              restorable=True, served_requests=True),
    "draft_overhead": ReasonFacts("draft_overhead", fallback="alert"),
    "latency_slo": ReasonFacts("latency", ("slowest",), "control_request", "disable", restorable=True),
    "kv_pressure": ReasonFacts("kv", fallback="reduce_first", restorable=True),
    "bundle_changed": ReasonFacts(None, fallback="invalidate"),
    "quality_regression": ReasonFacts("quality", ("mismatch",), "control_request", "disable"),
    "error_rate": ReasonFacts("errors", ("error", "timeout"), "control_request", "disable", restorable=True),
    "unadmitted_bundle": ReasonFacts(None, fallback="admission"),
    "canary_judgement": ReasonFacts(None, fallback="admission"),
})
"""Every decision reason (`schemas.decisions.Reason`), with its facts."""


_NO_FACTS = ReasonFacts(None)


def facts_of(reason: str) -> ReasonFacts:
    """The facts of ``reason``; a name that is no decision reason (``restore``) has none of its own.

    >>> from typing import get_args
    >>> from specwatch.schemas.decisions import Reason
    >>> sorted(REASONS) == sorted(get_args(Reason))  # every reason has its row
    True
    >>> facts_of("latency_slo").section, facts_of("restore").section, facts_of("restore").problem_samples
    ('latency', None, ('error', 'timeout', 'lowest_acceptance', 'slowest'))
    """
    return REASONS.get(reason, _NO_FACTS)


def restorable_reasons() -> list[str]:
    """The reasons a restore may undo unless the policy says otherwise, in table order.

    >>> restorable_reasons()
    ['acceptance_drop', 'no_speedup', 'latency_slo', 'kv_pressure', 'error_rate']
    """
    return [reason for reason, facts in REASONS.items() if facts.restorable]
