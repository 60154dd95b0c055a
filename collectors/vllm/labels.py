"""Task bucket and cohort of a vLLM request, read from its id and sampling parameters."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["BUCKET_ARG", "COHORT_ARG", "DEFAULT_BUCKET", "DEFAULT_COHORT", "Labeler",
           "request_labels"]

BUCKET_ARG = "specwatch_bucket"
COHORT_ARG = "specwatch_cohort"
DEFAULT_BUCKET = "default"
DEFAULT_COHORT = "main"

# Labels end up as keys of windows, tables and flag scopes: short, printable, no separators
# that the decision key (bundle/bucket/cohort) or the id prefix itself uses.
_LABEL = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID_PREFIX = re.compile(r"([A-Za-z0-9_.\-]{1,64}):([A-Za-z0-9_.\-]{1,64}):")

Labeler = Callable[[str, Mapping[str, Any] | None], "tuple[str, str] | None"]
"""A caller's own rule: ``(request_id, extra_args) -> (bucket, cohort)``, or None to fall back."""


def request_labels(request_id: str, extra_args: Mapping[str, Any] | None,
                   labeler: Labeler | None = None) -> tuple[str, str]:
    """(bucket, cohort) of one request: caller's rule, then extra_args, then id prefix, then defaults.

    Each label is resolved on its own; values that are not short printable names are ignored.

    >>> request_labels("coding:canary:42", None)
    ('coding', 'canary')
    >>> request_labels("42", {"specwatch_bucket": "extraction"})
    ('extraction', 'main')
    >>> request_labels("coding:canary:42", {"specwatch_cohort": "baseline"})
    ('coding', 'baseline')
    >>> request_labels("cmpl-7f3a", None)
    ('default', 'main')
    """
    if labeler is not None:
        chosen = labeler(request_id, extra_args)
        if chosen is not None:
            bucket, cohort = chosen
            if _valid(bucket) and _valid(cohort):
                return bucket, cohort
    bucket = cohort = None
    if extra_args:
        value = extra_args.get(BUCKET_ARG)
        bucket = value if _valid(value) else None
        value = extra_args.get(COHORT_ARG)
        cohort = value if _valid(value) else None
    if bucket is None or cohort is None:
        prefix = _ID_PREFIX.match(request_id)
        if prefix is not None:
            bucket = bucket or prefix.group(1)
            cohort = cohort or prefix.group(2)
    return bucket or DEFAULT_BUCKET, cohort or DEFAULT_COHORT


def _valid(value: object) -> bool:
    return isinstance(value, str) and _LABEL.fullmatch(value) is not None
