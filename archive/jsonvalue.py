"""Audit, evidence and spool entries as JSON: one normalisation for every place the archive writes JSON."""

from __future__ import annotations

import hashlib
import json
import math
from collections import abc
from typing import Any

__all__ = ["canonical_json", "digest_id", "plain"]


def plain(value: Any, *, keep_nan: bool = False) -> Any:
    """``value`` in JSON's own types (sets sorted, models and numpy values as what they hold), NaN
    and infinities as None unless ``keep_nan``; anything else as it is, for ``json.dumps``.

    >>> import numpy as np
    >>> plain({"al": np.float64("nan"), 2: (1, {3.5, 0.5}), "n": np.arange(2)})
    {'al': None, '2': [1, [0.5, 3.5]], 'n': [0, 1]}
    >>> plain([float("inf")], keep_nan=True)
    [inf]
    """
    kind = type(value)
    if kind is float:
        return value if keep_nan or math.isfinite(value) else None
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is dict or isinstance(value, abc.Mapping):
        return {str(k): plain(v, keep_nan=keep_nan) for k, v in value.items()}
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        return [plain(v, keep_nan=keep_nan) for v in value]
    if isinstance(value, float):
        return float(value) if keep_nan or math.isfinite(value) else None
    if isinstance(value, (set, frozenset)):
        return [plain(v, keep_nan=keep_nan) for v in sorted(value)]
    if hasattr(value, "model_dump"):
        return plain(value.model_dump(mode="json"), keep_nan=keep_nan)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return plain(value.tolist(), keep_nan=keep_nan)
    return value


def canonical_json(value: Any, *, keep_nan: bool = False) -> str:
    """Compact JSON with sorted keys, as the archive stores it; NaN and infinities become null,
    unless ``keep_nan`` (the spool's window stats must come back as NaN).

    >>> canonical_json({"b": float("nan"), "a": [1.5, (2, 3)]})
    '{"a":[1.5,[2,3]],"b":null}'
    """
    try:  # most values are plain already: one C-level pass
        return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=keep_nan)
    except (ValueError, TypeError):
        return json.dumps(plain(value, keep_nan=keep_nan), separators=(",", ":"), sort_keys=True,
                          allow_nan=keep_nan, default=_refuse)


def digest_id(prefix: str, value: Any) -> str:
    """A stable row id: ``prefix`` and a digest of the canonical JSON of ``value``.

    >>> digest_id("o-", {"b": 1, "a": [2]})
    'o-63c9663de90ee828'
    """
    return prefix + hashlib.sha256(canonical_json(value).encode()).hexdigest()[:16]


def _refuse(value: Any) -> Any:
    raise TypeError(f"cannot archive a {type(value).__name__} as JSON")
