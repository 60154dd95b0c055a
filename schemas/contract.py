"""Telemetry contract v1: the records engine workers emit, one JSON object per line."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from .scope import EVERY, SEPARATOR

__all__ = ["CONTRACT_VERSION", "MAX_DRAFT_TOKENS", "MAX_NAME_CHARS", "MAX_REQUESTS_PER_STEP", "BundleCard",
           "TargetCard", "DrafterCard",
           "RuntimeCard", "PolicyCard", "BundleRecord", "StepRecord", "RoundEntry", "RequestRecord",
           "Sample", "Sampling", "ShadowRecord", "TelemetryRecord", "bundle_digest",
           "card_differences", "printable", "scope_name_ok", "DraftLength", "Name", "ScopeName"]

CONTRACT_VERSION = 1
# A step of a real engine holds at most a few thousand running requests; anything
# larger is a broken or hostile producer, rejected rather than buffered.
MAX_REQUESTS_PER_STEP = 4096
# Names (workers, bundles, requests, buckets, cohorts) and the drafted and accepted counts of a round.
MAX_NAME_CHARS = 256
MAX_DRAFT_TOKENS = 64
_MAX_SEALED_CHARS = 1 << 20

# Names reach terminals, logs and dashboards: control characters (C0, DEL and C1, the
# ANSI escape among them), line and paragraph separators and bidirectional overrides
# could rewrite what an operator sees there.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# Decision scope keys are bundle/bucket/cohort with "*" for "every": a bucket or cohort
# named "*", or holding a "/", would collide with another scope's key.


def printable(text: str) -> bool:
    """Whether ``text`` holds none of the characters a name may not hold.

    >>> printable("coding"), printable("r\u00e9sum\u00e9 \u2764"), printable("x\x1b[31m"), printable("a\u202eb")
    (True, True, False, False)
    """
    # isprintable() is False for every character the pattern matches, and fast on ASCII
    return text.isprintable() or _UNPRINTABLE.search(text) is None


def scope_name_ok(text: str) -> bool:
    """Whether a bucket or cohort name can stand in a decision scope key.

    >>> scope_name_ok("coding"), scope_name_ok("*"), scope_name_ok("a/b"), scope_name_ok("**")
    (True, False, False, True)
    """
    return text != EVERY and SEPARATOR not in text


def _printable(value: str) -> str:
    if not printable(value):
        raise ValueError(f"{value[:64]!r} holds a control character, line separator or bidirectional override")
    return value


def _scope_name(value: str) -> str:
    if not scope_name_ok(value):
        raise ValueError(f"{value[:64]!r} cannot name a bucket or cohort: '*' means every one in decision "
                         "scopes, and '/' separates their parts")
    return value


def _only_version_one(value: object) -> object:
    # Literal[1] alone would take true and 1.0, which equal 1 in Python but not in JSON.
    if type(value) is not int:
        raise PydanticCustomError("literal_error", "Input should be the JSON number 1, got {value}",
                                  {"value": repr(value)})
    return value


Timestamp = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Millis = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_printable)]
ScopeName = Annotated[Name, AfterValidator(_scope_name)]
Text = Annotated[str, AfterValidator(_printable)]
# Tokens a drafter proposes per round: what a card, a draft limit or a rollback may name.
DraftLength = Annotated[int, Field(ge=1, le=MAX_DRAFT_TOKENS)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TargetCard(_Part):
    model_id: Name
    revision: Text = ""
    tokenizer_digest: Text = ""
    quantization: Text = "none"


class DrafterCard(_Part):
    mechanism: Literal["ngram", "eagle3", "mtp", "dflash", "dspark", "external"]
    revision: Text = ""
    draft_length: DraftLength


class RuntimeCard(_Part):
    engine: Text = ""
    gpu: Text = ""
    parallelism: Text = ""


class PolicyCard(_Part):
    acceptance_rule: Text = "strict"
    fallback: Text = "standard"


class BundleCard(_Part):
    """The immutable fingerprint of a speculative deployment."""

    target: TargetCard
    drafter: DrafterCard
    runtime: RuntimeCard = RuntimeCard()
    policy: PolicyCard = PolicyCard()

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def bundle_digest(card: BundleCard) -> str:
    """Stable digest of a fingerprint card: the same fields give the same id anywhere.

    >>> card = BundleCard(target=TargetCard(model_id="llama-8b", revision="r1"),
    ...                   drafter=DrafterCard(mechanism="eagle3", draft_length=4))
    >>> bundle_digest(card)
    'b-61c8f31ef8abcc20'
    """
    return "b-" + hashlib.sha256(card.canonical_json().encode()).hexdigest()[:16]


def card_differences(old: BundleCard, new: BundleCard) -> list[str]:
    """Dotted names of the card fields that differ, e.g. ``['target.revision']``."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    return sorted(
        f"{part}.{name}"
        for part in a
        for name in set(a[part]) | set(b[part])
        if a[part].get(name) != b[part].get(name)
    )


class _Record(_Part):
    v: Annotated[Literal[1], BeforeValidator(_only_version_one)]
    ts: Timestamp


class BundleRecord(_Record):
    kind: Literal["bundle"] = "bundle"
    worker: Name
    bundle_id: Name
    card: BundleCard


class RoundEntry(_Part):
    """One request's speculative round inside one engine step."""

    id: Name
    bucket: ScopeName
    cohort: ScopeName
    drafted: int = Field(ge=0, le=MAX_DRAFT_TOKENS)
    accepted: int = Field(ge=0, le=MAX_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _accepted_within_drafted(self) -> "RoundEntry":
        if self.accepted > self.drafted:
            raise ValueError(f"accepted_exceeds_drafted: accepted {self.accepted} > drafted {self.drafted}")
        return self


class StepRecord(_Record):
    kind: Literal["step"] = "step"
    worker: Name
    seq: int = Field(ge=0)
    bundle_id: Name
    draft_ms: Millis
    verify_ms: Millis
    kv_usage: float = Field(ge=0, le=1, allow_inf_nan=False)
    requests: list[RoundEntry]

    @field_validator("requests", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        if isinstance(value, list) and len(value) > MAX_REQUESTS_PER_STEP:
            raise ValueError(f"too_many_requests: {len(value)} > {MAX_REQUESTS_PER_STEP} per step")
        return value


class Sampling(_Part):
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=0)


class Sample(_Part):
    prompt_sha256: str | None = None
    output_sha256: str | None = None
    sampling: Sampling | None = None
    # Optional and additive: the request's token ids sealed for postmortems (see
    # schemas/sealed.py). Left out of the serialized form when absent, so records without
    # it keep the exact bytes they always had.
    sealed: str | None = Field(default=None, max_length=_MAX_SEALED_CHARS)

    @model_serializer(mode="wrap")
    def _without_absent_seal(self, handler):
        data = handler(self)
        if self.sealed is None and isinstance(data, dict):
            data.pop("sealed", None)
        return data


class RequestRecord(_Record):
    kind: Literal["request"] = "request"
    worker: Name
    bundle_id: Name
    id: Name
    bucket: ScopeName
    cohort: ScopeName
    speculative: bool
    ttft_ms: Millis
    tpot_ms: Millis | None
    e2e_ms: Millis
    output_tokens: int = Field(ge=0)
    finish_reason: Literal["stop", "length", "abort", "error", "timeout"]
    error: str | None = None
    sample: Sample | None = None

    @property
    def failed(self) -> bool:
        return self.finish_reason in ("error", "timeout")


class ShadowRecord(_Record):
    kind: Literal["shadow"] = "shadow"
    bundle_id: Name
    id: Name
    bucket: ScopeName
    check: Name
    match: bool


TelemetryRecord = Annotated[
    Union[BundleRecord, StepRecord, RequestRecord, ShadowRecord], Field(discriminator="kind")
]
