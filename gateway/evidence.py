"""Contract-v1 records from what the gateway saw of one response: its speculative metrics as step
records, its timings at the gateway as a request record, and the pool's card. Pure."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

from specwatch.schemas import (BundleCard, BundleRecord, DrafterCard, PolicyCard, RequestRecord, RuntimeCard,
                               ShadowRecord, StepRecord, TargetCard, bundle_digest)

__all__ = ["CARD_FIELDS_UNSEEN", "SHADOW_CHECK", "Exchange", "bundle_record", "card_from_server", "digest_text",
           "finish_reason", "request_record", "rounds", "shadow_record", "step_records"]

SHADOW_CHECK = "token_exact"
# OpenAI finish reasons onto the contract's; anything else a server invents is a normal stop.
_FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop",
                   "content_filter": "stop", "repetition": "stop", "abort": "abort"}
_MAX_ERROR_CHARS = 512

CARD_FIELDS_UNSEEN = ("target.quantization", "runtime.gpu", "runtime.parallelism")
"""Card fields no unmodified server tells a client: a plugin-less card leaves them at their defaults.
The target's revision and tokenizer digest, and the drafter's revision, are filled only where the
gateway can read the checkpoints; the drafter itself is the served configuration the operator names."""


def digest_text(value: Any) -> str:
    """sha256 of a prompt or output as the gateway saw it (canonical JSON of non-strings).

    >>> digest_text("hi")[:12], digest_text({"b": 1, "a": 2}) == digest_text({"a": 2, "b": 1})
    ('8f434346648f', True)
    """
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def finish_reason(openai_reason: str | None) -> str:
    """The contract's finish reason for an OpenAI one (None: the stream ended without one).

    >>> finish_reason("length"), finish_reason("tool_calls"), finish_reason(None)
    ('length', 'stop', 'abort')
    """
    if openai_reason is None:
        return "abort"
    return _FINISH_REASONS.get(openai_reason, "stop")


@dataclass
class Exchange:
    """One attempt of one request on one pool, timed at the gateway (wall clock, unix seconds)."""

    request_id: str
    bucket: str
    cohort: str
    pool: str
    started: float
    finished: float = 0.0
    first_token: float | None = None
    output_tokens: int = 0
    finish: str = "abort"
    error: str | None = None
    speculative_metrics: Mapping[str, Any] | None = None
    prompt_sha256: str | None = None
    output_sha256: str | None = None
    sampling: dict = field(default_factory=dict)
    token_ids: list[int] | None = None

    @property
    def failed(self) -> bool:
        return self.finish in ("error", "timeout")


def rounds(metrics: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(drafted, accepted) of every verify step of a request, from vLLM's per-request metrics.

    ``detailed`` gives them in order. ``summary`` gives how many steps accepted exactly j drafts
    and the draft total; each step is taken to draft D, short steps being the least accepting.

    >>> rounds({"per_step_drafted": [4, 4, 2], "per_step_accepted": [1, 4, 0]})
    [(4, 1), (4, 4), (2, 0)]
    >>> rounds({"acceptance_histogram": [2, 0, 1], "num_draft_tokens": 5, "num_spec_tokens": 2})
    [(1, 0), (2, 0), (2, 2)]
    """
    drafted = metrics.get("per_step_drafted")
    accepted = metrics.get("per_step_accepted")
    if isinstance(drafted, list) and isinstance(accepted, list) and len(drafted) == len(accepted):
        return [(int(d), min(int(a), int(d))) for d, a in zip(drafted, accepted)]
    histogram = metrics.get("acceptance_histogram") or []
    d = int(metrics.get("num_spec_tokens") or 0)
    steps = sorted(j for j, n in enumerate(histogram) for _ in range(int(n)))
    out = [[d, j] for j in steps]
    shortfall = len(out) * d - int(metrics.get("num_draft_tokens") or 0)
    for pair in out:  # the least accepting steps are where drafts ran short (end of a request)
        if shortfall <= 0:
            break
        cut = min(shortfall, pair[0] - max(pair[1], 1))
        pair[0] -= cut
        shortfall -= cut
    return [(a, b) for a, b in out]


def step_records(worker: str, bundle_id: str, exchange: Exchange, first_seq: int,
                 kv_usage: float = 0.0) -> list[StepRecord]:
    """One step record per verify step of a speculative response, spread over its decode time.

    The gateway cannot time drafter and target: ``draft_ms`` and ``verify_ms`` are 0, so the
    speedup and draft-cost gates have nothing to judge from gateway telemetry (their ratios are
    undefined), while acceptance per position, per bucket and cohort, is exact.
    """
    if exchange.speculative_metrics is None:
        return []
    pairs = rounds(exchange.speculative_metrics)
    start = exchange.first_token if exchange.first_token is not None else exchange.started
    span = max(0.0, exchange.finished - start)
    records = []
    for i, (drafted, accepted) in enumerate(pairs):
        ts = start + span * (i + 1) / len(pairs)
        records.append(StepRecord.model_validate({
            "v": 1, "ts": ts, "worker": worker, "seq": first_seq + i, "bundle_id": bundle_id,
            "draft_ms": 0.0, "verify_ms": 0.0, "kv_usage": min(1.0, max(0.0, kv_usage)),
            "requests": [{"id": exchange.request_id, "bucket": exchange.bucket, "cohort": exchange.cohort,
                          "drafted": drafted, "accepted": accepted}]}))
    return records


def request_record(worker: str, bundle_id: str, exchange: Exchange, speculative: bool) -> RequestRecord:
    """The request record of one attempt: TTFT, TPOT and e2e as the client saw them at the gateway."""
    e2e_ms = max(0.0, (exchange.finished - exchange.started) * 1e3)
    first = exchange.first_token
    ttft_ms = max(0.0, (first - exchange.started) * 1e3) if first is not None else e2e_ms
    tpot_ms = (max(0.0, (exchange.finished - first) * 1e3 / (exchange.output_tokens - 1))
               if first is not None and exchange.output_tokens > 1 else None)
    error = exchange.error[:_MAX_ERROR_CHARS] if exchange.error else None
    sampling = {k: exchange.sampling.get(k) for k in ("temperature", "top_p", "seed", "max_tokens")}
    return RequestRecord.model_validate({
        "v": 1, "ts": exchange.finished, "worker": worker, "bundle_id": bundle_id, "id": exchange.request_id,
        "bucket": exchange.bucket, "cohort": exchange.cohort, "speculative": speculative, "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms, "e2e_ms": e2e_ms, "output_tokens": exchange.output_tokens,
        "finish_reason": exchange.finish, "error": error,
        "sample": {"prompt_sha256": exchange.prompt_sha256, "output_sha256": exchange.output_sha256,
                   "sampling": _sampling(sampling)}})


def _sampling(values: dict) -> dict:
    """Sampling fields of the contract's types; a client's odd value is left out, not refused."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[name] = float(value) if name == "temperature" else min(1.0, float(value))
    for name in ("seed", "max_tokens"):
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and (name == "seed" or value >= 0):
            out[name] = value
    return out


def shadow_record(bundle_id: str, request_id: str, bucket: str, match: bool, ts: float) -> ShadowRecord:
    return ShadowRecord(v=1, ts=ts, bundle_id=bundle_id, id=request_id, bucket=bucket, check=SHADOW_CHECK,
                        match=match)


def card_from_server(models: Mapping[str, Any], speculative_config: Mapping[str, Any], version: str | None,
                     model_dir: str | None = None) -> BundleCard:
    """The pool's card from its ``/v1/models``, its ``/version`` and the speculative config it was
    started with; checkpoint digests only where ``model_dir`` (or the served root) is readable here.
    Fields an unmodified server does not tell: `CARD_FIELDS_UNSEEN`."""
    from specwatch.collectors.vllm.bundle import (checkpoint_revision, drafter_mechanism, drafter_revision,
                                                  tokenizer_digest)

    data = models.get("data") or []
    if not data:
        raise ValueError("the speculative pool's /v1/models lists no model")
    served = data[0]
    root = model_dir or served.get("root") or served["id"]
    method = str(speculative_config.get("method") or "")
    draft_length = int(speculative_config.get("num_speculative_tokens") or 0)
    if draft_length < 1:
        raise ValueError("the served speculative config needs num_speculative_tokens >= 1")
    spec = SimpleNamespace(method=method, model=speculative_config.get("model"),
                           revision=speculative_config.get("revision"),
                           prompt_lookup_min=speculative_config.get("prompt_lookup_min"),
                           prompt_lookup_max=speculative_config.get("prompt_lookup_max"),
                           suffix_decoding_max_tree_depth=speculative_config.get("suffix_decoding_max_tree_depth"))
    rule = speculative_config.get("rejection_sample_method", "standard")
    return BundleCard(
        target=TargetCard(model_id=str(served["id"])[-256:], revision=checkpoint_revision(root),
                          tokenizer_digest=tokenizer_digest(root)),
        drafter=DrafterCard(mechanism=drafter_mechanism(method), revision=drafter_revision(spec),
                            draft_length=draft_length),
        runtime=RuntimeCard(engine=f"vllm-{version}" if version else "vllm"),
        policy=PolicyCard(acceptance_rule="strict" if rule == "standard" else str(rule)))


def bundle_record(worker: str, card: BundleCard, ts: float) -> BundleRecord:
    return BundleRecord(v=1, ts=ts, worker=worker, bundle_id=bundle_digest(card), card=card)
