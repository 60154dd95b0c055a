"""The compiled step walks (the package specwatch_native, built from native/), each made with the
settings it reads by, and which path each encoding's block decoder takes by default."""

from __future__ import annotations

import os
from typing import Any

from .codec import MAX_LINE_BYTES
from .contract import MAX_DRAFT_TOKENS, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP
from .otlp_layout import (ACCEPTED_KEY, BUCKET_KEY, BUNDLE_KEY, COHORT_KEY, DRAFT_HEAD, DRAFTED_KEY, EVENT_FIELD,
                          ID_KEY, KV_HEAD, SEQ_HEADS, V_TS_HEAD, VERIFY_HEAD, WORKER_KEY)
from .scope import EVERY, SEPARATOR
from .step_block import MAX_EXACT_INT

__all__ = ["DECODER", "DECODERS", "LINE_WALK", "STEP_WALK", "native_walk"]


def native_walk(name: str, *settings: Any) -> Any:
    """A compiled step walk (the package specwatch_native, built from native/) made with
    ``settings``, or None: not built on this machine (or built before it had this walk), or
    SPECWATCH_NATIVE=0 asks for the reference path."""
    if os.environ.get("SPECWATCH_NATIVE", "1") == "0":
        return None
    try:
        import specwatch_native
    except ImportError:
        return None
    walk = getattr(specwatch_native, name, None)
    return None if walk is None else walk(*settings)


# the layout's bytes as the writer makes them here: the two readers cannot drift apart
STEP_WALK = native_walk("StepWalk", V_TS_HEAD, SEQ_HEADS, (DRAFT_HEAD, VERIFY_HEAD, KV_HEAD), WORKER_KEY,
                        BUNDLE_KEY, (ID_KEY, BUCKET_KEY, COHORT_KEY, DRAFTED_KEY, ACCEPTED_KEY),
                        EVENT_FIELD, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, MAX_DRAFT_TOKENS, EVERY.encode(),
                        ord(SEPARATOR))
LINE_WALK = native_walk("LineWalk", MAX_LINE_BYTES, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, MAX_DRAFT_TOKENS,
                        float(MAX_EXACT_INT), EVERY.encode(), ord(SEPARATOR))
# which path each encoding's block decoder takes by default: the bench report names them
DECODERS = {"jsonl": "reference" if LINE_WALK is None else "native",
            "otlp": "reference" if STEP_WALK is None else "native"}
DECODER = "native" if set(DECODERS.values()) == {"native"} else "reference"
