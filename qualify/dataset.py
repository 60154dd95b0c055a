"""The qualification dataset: JSON Lines, one request each (prompt or messages, bucket, sampling,
optional checks); bad lines are rejected with their line number and reason, the rest is kept."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specwatch.schemas.contract import Name, ScopeName

__all__ = ["DEFAULT_DATASET", "Checks", "Dataset", "QualificationRequest", "RequestSampling", "context_overflow",
           "load_dataset"]

DEFAULT_DATASET = "default.jsonl"
"""The dataset shipped with specwatch (package data of specwatch.qualify)."""

_MAX_SAMPLES = 4096
_MAX_TOKENS = 1 << 16


class RequestSampling(BaseModel):
    """How a request is decoded: ``temperature`` 0 is greedy (judged token by token), above 0 it is
    drawn ``samples`` times on each path with seeds ``seed``, ``seed + 1``, ... (judged by distribution)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int = Field(64, ge=1, le=_MAX_TOKENS)
    seed: int = Field(0, ge=0)
    samples: int = Field(1, ge=1, le=_MAX_SAMPLES)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @model_validator(mode="after")
    def _samples(self) -> "RequestSampling":
        if self.greedy and self.samples != 1:
            raise ValueError("a greedy request is drawn once: samples must be 1 when temperature is 0")
        return self


class Checks(BaseModel):
    """Task checks on one output; each runs on both paths and is compared."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | None = Field(None, description="the output parses as JSON and validates")
    tool_call: dict[str, Any] | None = Field(
        None, description="the output is {\"name\": ..., \"arguments\": {...}}; this is the arguments' "
                          "JSON schema, with the expected tool name under \"x-tool-name\"")
    regex: str | None = Field(None, description="Python regular expression the output must match (search)")
    code_test: str | None = Field(
        None, description="shell command that must exit 0; {output} is replaced by a file holding the output")
    stop_reason: Literal["stop", "length"] | None = Field(None, description="the finish reason expected")


class QualificationRequest(BaseModel):
    """One line of the dataset."""

    model_config = ConfigDict(extra="forbid")

    id: Name
    bucket: ScopeName
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: RequestSampling = Field(default_factory=RequestSampling)
    checks: Checks = Field(default_factory=Checks)

    @model_validator(mode="after")
    def _one_input(self) -> "QualificationRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (completions) or messages (chat completions)")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    @property
    def check_names(self) -> list[str]:
        return [name for name, value in self.checks if value is not None]


def context_overflow(requests: Sequence[QualificationRequest], prompt_tokens: Mapping[str, int],
                     max_model_len: int) -> list[dict]:
    """The requests that cannot run as written within ``max_model_len``: prompt tokens plus
    ``max_tokens`` beyond it (vLLM refuses a longer prompt and silently cuts ``max_tokens``
    short otherwise). A request whose prompt was not counted is kept.

    >>> reqs = [QualificationRequest(id="a", bucket="long_context", prompt="x", sampling={"max_tokens": 32}),
    ...         QualificationRequest(id="b", bucket="coding", prompt="y", sampling={"max_tokens": 32})]
    >>> context_overflow(reqs, {"a": 718, "b": 480}, 512)
    [{'id': 'a', 'bucket': 'long_context', 'verdict': 'skipped: exceeds max_model_len 512', 'prompt_tokens': 718, 'max_tokens': 32}]
    """
    return [{"id": r.id, "bucket": r.bucket, "verdict": f"skipped: exceeds max_model_len {max_model_len}",
             "prompt_tokens": prompt_tokens[r.id], "max_tokens": r.sampling.max_tokens}
            for r in requests if r.id in prompt_tokens and prompt_tokens[r.id] + r.sampling.max_tokens > max_model_len]


@dataclass
class Dataset:
    """The requests kept, the lines rejected (line number -> reason), a digest of the file, and the
    requests left out of a run because the servers cannot hold them (``context_overflow`` rows)."""

    name: str
    requests: list[QualificationRequest]
    digest: str
    rejected: dict[int, str] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)

    def buckets(self) -> dict[str, int]:
        return dict(sorted(Counter(r.bucket for r in self.requests).items()))

    def limited(self, per_bucket: int | None) -> "Dataset":
        """At most ``per_bucket`` requests of each bucket, in file order (a quicker run)."""
        if per_bucket is None:
            return self
        seen: Counter = Counter()
        kept = []
        for request in self.requests:
            seen[request.bucket] += 1
            if seen[request.bucket] <= per_bucket:
                kept.append(request)
        return Dataset(self.name, kept, self.digest, self.rejected, self.skipped)

    def without(self, skipped: list[dict]) -> "Dataset":
        """The requests not named in ``skipped``; the skipped ones are kept in ``skipped`` with their verdict."""
        names = {row["id"] for row in skipped}
        return Dataset(self.name, [r for r in self.requests if r.id not in names], self.digest, self.rejected,
                       self.skipped + list(skipped))

    def summary(self) -> dict:
        return {"name": self.name, "digest": self.digest, "requests": len(self.requests),
                "buckets": self.buckets(), "rejected": {str(k): v for k, v in sorted(self.rejected.items())},
                "skipped": {row["id"]: row["verdict"] for row in self.skipped}}


def load_dataset(path: str | Path | None = None) -> Dataset:
    """The dataset at ``path`` (the shipped default when None). Raises ValueError when not one line
    is a request; duplicate ids are rejected after their first line.

    >>> data = load_dataset()
    >>> sorted(data.buckets())
    ['coding', 'extraction', 'long_context', 'reasoning', 'structured', 'summarization']
    >>> data.rejected
    {}
    """
    if path is None:
        text = resources.files("specwatch.qualify").joinpath("data", DEFAULT_DATASET).read_text("utf-8")
        name = f"specwatch:{DEFAULT_DATASET}"
    else:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the dataset {path}: {error}") from None
        name = str(path)
    requests, rejected, ids = [], {}, set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            request = QualificationRequest.model_validate(json.loads(line))
        except json.JSONDecodeError as error:
            rejected[number] = f"not JSON: {error.msg}"
            continue
        except ValidationError as error:
            first = error.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "line"
            rejected[number] = f"{where}: {first.get('msg', '')}"
            continue
        if request.id in ids:
            rejected[number] = f"duplicate id {request.id!r}"
            continue
        ids.add(request.id)
        requests.append(request)
    if not requests:
        detail = "; ".join(f"line {n}: {r}" for n, r in list(rejected.items())[:3])
        raise ValueError(f"the dataset {name} holds no request" + (f" ({detail})" if detail else ""))
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return Dataset(name, requests, digest, rejected)
