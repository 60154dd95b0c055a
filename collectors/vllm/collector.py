"""The vLLM collector: contract-v1 records from a running engine, and its fallback flag view.

Hooks hand it tuples; a background thread validates them into records for ``sink.emit``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from specwatch.schemas import (MAX_REQUESTS_PER_STEP, BundleCard, BundleRecord, RequestRecord, StepRecord,
                               TelemetryRecord, bundle_digest)
from specwatch.collectors.capture import SampleCapture
from specwatch.schemas.contract import MAX_NAME_CHARS
from specwatch.schemas.sealed import token_digest

__all__ = ["BUCKET_ARG", "COHORT_ARG", "DEFAULT_BUCKET", "DEFAULT_COHORT", "CollectorStats",
           "Labeler", "RequestPayload", "StepPayload", "VllmCollector", "request_labels"]

_LOG = logging.getLogger(__name__)

# Records waiting for the sink (a few MB of step records); beyond it records are dropped.
_DEFAULT_QUEUE_SIZE = 8192
# Drained on a period, not woken per record (docs/DEPLOY.md, "Inside the collector").
_DEFAULT_DRAIN_INTERVAL_S = 0.1
_DEFAULT_FLUSH_TIMEOUT_S = 10.0
# Repeated failures of the same kind are logged at the first occurrence and then every N-th.
_LOG_EVERY = 1000

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

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error",
                   # vLLM stops a request on a detected repetition loop: a stop, not a failure
                   "repetition": "stop"}


@dataclass(frozen=True)
class CollectorStats:
    """Counters of one collector; engine-thread cost is the time spent inside its hooks."""

    steps: int
    untimed_steps: int  # steps without the runner's draft/verify times (runner not tapped)
    step_records: int
    request_records: int
    bundle_records: int
    dropped: int
    rejected: int
    emit_errors: int
    hook_errors: int
    flag_errors: int
    cost_s: float
    cost_max_s: float


class VllmCollector:
    """Per-step and per-request telemetry of vLLM engines, plus the flag view they obey.

    Engines built inside ``with collector.watching():`` in this process are tapped; while
    ``enabled`` is False the hooks pass straight through (docs/DEPLOY.md, "Inside the collector").
    """

    def __init__(self, sink: Any = None, *, flags: Any = None,
                 worker: str | None = None, labeler: Labeler | None = None,
                 queue_size: int = _DEFAULT_QUEUE_SIZE, capture: SampleCapture | None = None) -> None:
        if sink is not None and not callable(getattr(sink, "emit", None)):
            raise ValueError(f"sink must have an emit(record) method, got {type(sink).__name__}")
        if flags is not None and not callable(getattr(flags, "lookup", None)):
            raise ValueError("flags must have lookup(bundle_id, bucket, cohort), "
                             f"got {type(flags).__name__}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        worker = worker or f"{socket.gethostname()}-{os.getpid()}"
        if not 1 <= len(worker) <= MAX_NAME_CHARS:
            raise ValueError(f"worker name must be 1..{MAX_NAME_CHARS} characters, got {worker!r}")
        self.sink = sink
        self.flags = flags
        self.worker = worker
        self.labeler = labeler
        self.capture = capture
        self._queue_size = queue_size
        self.enabled = True
        self._bundles: dict[str, BundleCard] = {}
        self._bundle_keys: dict[tuple, tuple[str, BundleCard]] = {}
        self._bundle_lock = threading.Lock()
        self._pending: deque = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        # counters, written by one thread each (engine thread or emitter thread)
        self._steps = 0
        self._untimed_steps = 0
        self._cost_ns = 0
        self._cost_max_ns = 0
        self._records = {"bundle": 0, "step": 0, "request": 0}
        # dropped, rejected, emit_errors, hook_errors, flag_errors (`_failed`)
        self._failures: Counter[str] = Counter()

    @property
    def bundles(self) -> dict[str, BundleCard]:
        """Bundle id -> fingerprint card of every engine bound to this collector."""
        with self._bundle_lock:
            return dict(self._bundles)

    def watching(self) -> contextlib.AbstractContextManager["VllmCollector"]:
        """Tap the vLLM engines built in this process (engine core too) while the block runs."""
        from . import plugin

        return plugin.watching(self)

    def stats(self) -> CollectorStats:
        return CollectorStats(
            steps=self._steps,
            untimed_steps=self._untimed_steps,
            step_records=self._records["step"],
            request_records=self._records["request"],
            bundle_records=self._records["bundle"],
            dropped=self._failures["dropped"],
            rejected=self._failures["rejected"],
            emit_errors=self._failures["emit_errors"],
            hook_errors=self._failures["hook_errors"],
            flag_errors=self._failures["flag_errors"],
            cost_s=self._cost_ns / 1e9,
            cost_max_s=self._cost_max_ns / 1e9,
        )

    def flush(self, timeout: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until every record submitted so far went to the sink; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending or not self._idle.is_set():
            self._wake.set()
            if time.monotonic() >= deadline:
                return False
            self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return True

    def close(self, timeout: float = _DEFAULT_FLUSH_TIMEOUT_S) -> None:
        """Flush, then stop the emitter thread. Tapped engines keep running untouched."""
        self.flush(timeout)
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        close_sink = getattr(self.sink, "_close_owned", None)
        if close_sink is not None:
            close_sink()

    def bundle_for(self, vllm_config: Any) -> tuple[str, BundleCard]:
        """(bundle id, card) of an engine configuration, computed once per configuration."""
        from .bundle import describe_bundle

        key = _config_key(vllm_config)
        with self._bundle_lock:
            known = self._bundle_keys.get(key)
        if known is not None:
            return known
        card = describe_bundle(vllm_config)
        result = (bundle_digest(card), card)
        with self._bundle_lock:
            self._bundle_keys[key] = result
            self._bundles[result[0]] = card
        return result

    def submit(self, payload: StepPayload | RequestPayload | tuple) -> None:
        """Queue one engine-side payload for the emitter thread; never blocks, drops when full."""
        if self.sink is None or self._closed:
            return
        if len(self._pending) >= self._queue_size:
            self._failed("dropped", "sink is not keeping up: records dropped")
            return
        self._pending.append(payload)
        if self._thread is None:
            self._start_thread()
        elif len(self._pending) * 2 > self._queue_size and not self._wake.is_set():
            self._wake.set()  # a burst: drain now rather than drop later

    def account_step(self, cost_ns: int, timed: bool = True) -> None:
        self._steps += 1
        if not timed:
            self._untimed_steps += 1
        self._cost_ns += cost_ns
        if cost_ns > self._cost_max_ns:
            self._cost_max_ns = cost_ns

    def hook_failed(self, where: str, error: BaseException) -> None:
        self._failed("hook_errors", "hook %s failed; the engine continues without this step's "
                     "telemetry", where, error=error)

    def flag_failed(self, error: BaseException) -> None:
        # Fail open: a broken flag view must not change what the engine does; the lossless
        # contract holds either way and the error is counted.
        self._failed("flag_errors", "flag lookup failed; speculation stays as configured",
                     error=error)

    def _failed(self, kind: str, message: str, *args: Any,
                error: BaseException | None = None) -> None:
        """Count a failure; log the first of its kind and then every _LOG_EVERY-th."""
        self._failures[kind] += 1
        count = self._failures[kind]
        if count % _LOG_EVERY == 1:
            _LOG.log(logging.WARNING if error is None else logging.ERROR,
                     f"specwatch {message} (%d so far)", *args, count, exc_info=error)

    def _start_thread(self) -> None:
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specwatch-vllm-emit",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(_DEFAULT_DRAIN_INTERVAL_S)
            self._wake.clear()
            if self._pending:
                self._idle.clear()
            while self._pending:
                payload = self._pending.popleft()
                record = self._build(payload)
                if record is not None:
                    try:
                        self.sink.emit(record)
                        self._records[record.kind] += 1
                    except Exception as error:  # a sink failure must not stop telemetry
                        self._failed("emit_errors", "sink failed to emit a %s record", record.kind,
                                     error=error)
                # Hand the GIL back after every record: the engine thread, not this one, should
                # wait least (without this, a drained batch held it up to the 5 ms switch
                # interval and showed up as millisecond stalls inside engine steps).
                time.sleep(0)
            self._idle.set()
            if self._closed and not self._pending:
                return

    def _build(self, payload: StepPayload | RequestPayload | tuple) -> TelemetryRecord | None:
        try:
            kind = payload[0]
            if kind == "step":
                return _step_record(self.worker, payload)
            if kind == "request":
                return _request_record(self.worker, payload, self.capture)
            _, ts, bundle_id, card = payload
            return BundleRecord(v=1, ts=ts, worker=self.worker, bundle_id=bundle_id, card=card)
        except Exception as error:  # a payload that breaks the contract is a bug: count, say so
            self._failed("rejected", "dropped a %s record that failed validation", payload[0],
                         error=error)
            return None


def _config_key(vllm_config: Any) -> tuple:
    model = vllm_config.model_config
    spec = vllm_config.speculative_config
    parallel = vllm_config.parallel_config
    return (model.model, model.revision, model.tokenizer, str(model.dtype), model.quantization,
            getattr(spec, "method", None), getattr(spec, "model", None),
            getattr(spec, "num_speculative_tokens", None), parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size, parallel.data_parallel_size)


def _short(request_id: str) -> str:
    return request_id if len(request_id) <= MAX_NAME_CHARS else request_id[-MAX_NAME_CHARS:]


_NO_ROUND = (0, 0)


class StepPayload(NamedTuple):
    """One engine step as the scheduler tap hands it over: the batch as columns (ids, their
    labels, rounds by id); the emitter thread builds the per-request rows from them."""

    kind: Literal["step"]
    ts: float
    seq: int
    bundle_id: str
    draft_s: float
    verify_s: float
    kv_usage: float
    ids: list[str]
    labels: list[tuple[str, str]]  # (bucket, cohort) of each id
    rounds: Mapping[str, tuple[int, int]]  # id -> (drafted, accepted); absent: no speculative round


class RequestPayload(NamedTuple):
    """One finished request as the scheduler tap hands it over (times are unix seconds)."""

    kind: Literal["request"]
    ts: float
    bundle_id: str
    request_id: str
    bucket: str
    cohort: str
    speculative: bool
    arrival: float
    first_token_ts: float | None
    last_token_ts: float | None
    output_tokens: int
    finish_reason: str
    error: str | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    sampling: tuple  # (temperature, top_p, seed, max_tokens)


def _step_record(worker: str, payload: StepPayload) -> StepRecord:
    _, ts, seq, bundle_id, draft_s, verify_s, kv_usage, ids, labels, rounds = payload
    requests = []
    for rid, (bucket, cohort) in zip(ids, labels):
        drafted, accepted = rounds.get(rid, _NO_ROUND)
        requests.append({"id": _short(rid), "bucket": bucket, "cohort": cohort, "drafted": drafted,
                         "accepted": accepted})
    return StepRecord.model_validate({
        "v": 1, "ts": ts, "worker": worker, "seq": seq, "bundle_id": bundle_id,
        "draft_ms": draft_s * 1e3, "verify_ms": verify_s * 1e3,
        "kv_usage": min(1.0, max(0.0, float(kv_usage))), "requests": requests,
    })


def split_step(ids: list[str], labels: list[tuple[str, str]]) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """A step's (ids, labels) columns in contract-sized parts (a batch above MAX_REQUESTS_PER_STEP).

    >>> [len(part_ids) for part_ids, _ in split_step(["r"] * (MAX_REQUESTS_PER_STEP + 1), [("b", "c")] * 4097)]
    [4096, 1]
    """
    if len(ids) <= MAX_REQUESTS_PER_STEP:
        return [(ids, labels)]
    return [(ids[i:i + MAX_REQUESTS_PER_STEP], labels[i:i + MAX_REQUESTS_PER_STEP])
            for i in range(0, len(ids), MAX_REQUESTS_PER_STEP)]


def _request_record(worker: str, payload: RequestPayload, capture: SampleCapture | None = None) -> RequestRecord:
    (_, ts, bundle_id, rid, bucket, cohort, speculative, arrival, first_ts, last_ts, n_out,
     finish_reason, error, prompt_ids, output_ids, sampling) = payload
    first_ts = first_ts if first_ts is not None else ts
    ttft_ms = max(0.0, (first_ts - arrival) * 1e3)
    tpot_ms = (max(0.0, (last_ts - first_ts) * 1e3 / (n_out - 1))
               if n_out > 1 and last_ts is not None else None)
    temperature, top_p, seed, max_tokens = sampling
    sample = {"prompt_sha256": token_digest(prompt_ids), "output_sha256": token_digest(output_ids),
              "sampling": {"temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens}}
    if capture is not None:  # chosen by the engine's request id, bound to the id the record carries
        sample["sealed"] = capture.seal(rid, bucket, prompt_ids, output_ids, sample_id=_short(rid))
    return RequestRecord.model_validate({
        "v": 1, "ts": ts, "worker": worker, "bundle_id": bundle_id, "id": _short(rid),
        "bucket": bucket, "cohort": cohort, "speculative": speculative,
        "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "e2e_ms": max(0.0, (ts - arrival) * 1e3),
        "output_tokens": n_out, "finish_reason": _FINISH_REASONS.get(finish_reason, "error"),
        "error": error,
        "sample": sample,
    })


def request_labels(request_id: str, extra_args: Mapping[str, Any] | None,
                   labeler: Labeler | None = None) -> tuple[str, str]:
    """(bucket, cohort) of one request: caller's rule, extra_args, id prefix, defaults, in order.

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
