"""The scope a decision and its statistics are about: a (bundle, bucket, cohort) key, and its one
text form (``bundle/bucket/cohort``, with ``*`` for every bucket or cohort)."""

from __future__ import annotations

__all__ = ["EVERY", "SEPARATOR", "Scope", "scope_from_text", "scope_text"]

Scope = tuple[str, str | None, str | None]
"""(bundle_id, bucket, cohort); a bucket or cohort of None covers every one of the bundle."""

EVERY = "*"
"""The text form of None in a scope; the contract refuses it as a bucket or cohort name."""
SEPARATOR = "/"
"""Between the parts of a scope's text; the contract refuses it in a bucket or cohort name."""


def scope_text(scope: Scope) -> str:
    """The text form of a scope: Kafka keys, checkpoints, logs and messages.

    >>> scope_text(("b-1", "coding", "main")), scope_text(("b-1", None, None))
    ('b-1/coding/main', 'b-1/*/*')
    """
    bundle_id, bucket, cohort = scope
    return SEPARATOR.join((bundle_id, bucket or EVERY, cohort or EVERY))


def scope_from_text(text: str) -> Scope:
    """The scope `scope_text` wrote (a bundle id may hold ``/``; a bucket or cohort may not).

    >>> scope_from_text("b/1/coding/*")
    ('b/1', 'coding', None)
    """
    bundle_id, bucket, cohort = text.rsplit(SEPARATOR, 2)
    return bundle_id, (None if bucket == EVERY else bucket), (None if cohort == EVERY else cohort)
