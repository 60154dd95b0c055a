"""What of a contract record's free text may be kept outside the engine: hashes by default."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["SAMPLE_TEXT_MODES", "SampleText", "redact_record", "redact_text"]

SampleText = Literal["hashes", "redacted"]
SAMPLE_TEXT_MODES: tuple[str, ...] = ("hashes", "redacted")

# Fields of contract records (at their top level) that hold free text from the engine.
_FREE_TEXT_FIELDS = ("error",)
_DIGEST_CHARS = 16
_REDACTED_MAX_CHARS = 160
# Quoted spans are where engines put user content ("invalid token 'xyz'"); long runs of
# digits may be ids or numbers from the input; both go.
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`|«[^»]*»")
_LONG_NUMBER = re.compile(r"\d{5,}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIGEST_FORM = re.compile(r"sha256:[0-9a-f]{16}")


def redact_text(text: str, mode: SampleText = "hashes") -> str:
    """The form of one free-text value that may be stored.

    >>> redact_text("CUDA error: an illegal memory access")
    'sha256:8c4d8aa82ff7b632'
    >>> redact_text("tokenizer failed on 'my secret prompt' at 1234567\\nmore", "redacted")
    'tokenizer failed on «…» at #…'
    >>> redact_text(redact_text("oom")) == redact_text("oom")
    True
    """
    if mode not in SAMPLE_TEXT_MODES:
        raise ValueError(f"sample text mode must be one of {', '.join(SAMPLE_TEXT_MODES)}, got {mode!r}")
    if mode == "hashes":
        if _DIGEST_FORM.fullmatch(text):
            return text
        return "sha256:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:_DIGEST_CHARS]
    first = text.splitlines()[0] if text else ""
    first = _LONG_NUMBER.sub("#…", _QUOTED.sub("«…»", first))
    first = _CONTROL.sub(" ", first).strip()
    return first if len(first) <= _REDACTED_MAX_CHARS else first[:_REDACTED_MAX_CHARS - 1] + "…"


def redact_record(record: Mapping[str, Any], mode: SampleText = "hashes") -> dict[str, Any]:
    """A copy of a contract record dict with its free-text fields made storable.

    >>> redact_record({"kind": "request", "id": "r1", "error": None})["error"] is None
    True
    >>> redact_record({"kind": "request", "id": "r1", "error": "oom"})["error"]
    'sha256:cd2452db7d582ea2'
    """
    out = dict(record)
    for name in _FREE_TEXT_FIELDS:
        if out.get(name) is not None:
            out[name] = redact_text(str(out[name]), mode)
    return out
