"""Gate 2, the end-to-end ledger: both paths under the same load at each concurrency, from a load
generator's results; per slice, whether TTFT or decode got faster, throughput, tails against the
baseline and the policy's SLOs, errors and KV peak. Pure: results in, a `GateResult` out."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from specwatch.schemas.slice_stats import ratio, round_evidence
from specwatch.schemas.policy import Policy
from specwatch.schemas.qualification import GateResult

__all__ = ["LEDGER_FIELDS", "bucket_rows", "judge_gate2", "ledger_row"]

LEDGER_FIELDS = (
    "concurrency", "completed", "failed", "duration_s", "request_tok_s", "output_tok_s",
    "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p95_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms",
    "queue_mean_ms", "queue_p99_ms", "draft_length", "acceptance_length", "rejection_rate",
    "position_acceptance", "kv_peak",
)
"""One row of the ledger: one path at one concurrency."""

_TAILS = ("ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms")


def _number(value) -> float:
    return float(value) if value is not None else math.nan


def ledger_row(result: Mapping, concurrency: int, draft_length: int, kv_peak: float | None = None) -> dict:
    """A ledger row from one run of vLLM's benchmark client (`vllm.benchmarks.serve`'s result dict).

    >>> r = {"completed": 8, "failed": 0, "duration": 2.0, "request_throughput": 4.0, "output_throughput": 64.0,
    ...      "p50_ttft_ms": 30.0, "p99_tpot_ms": 9.0, "queue_times": [0.001, 0.003],
    ...      "spec_decode_acceptance_length": 2.5, "spec_decode_acceptance_rate": 50.0}
    >>> row = ledger_row(r, 4, 3)
    >>> row["output_tok_s"], row["ttft_p50_ms"], row["queue_mean_ms"], row["acceptance_length"], row["rejection_rate"]
    (64.0, 30.0, 2.0, 2.5, 0.5)
    """
    row = {"concurrency": concurrency, "completed": int(result.get("completed") or 0),
           "failed": int(result.get("failed") or 0), "duration_s": _number(result.get("duration")),
           "request_tok_s": _number(result.get("request_throughput")),
           "output_tok_s": _number(result.get("output_throughput"))}
    for metric, name in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e")):
        for q in ("50", "95", "99"):
            row[f"{name}_p{q}_ms"] = _number(result.get(f"p{q}_{metric}_ms"))
    queue = np.array(result.get("queue_times") or [], dtype=float) * 1000.0
    row["queue_mean_ms"] = float(queue.mean()) if queue.size else math.nan
    row["queue_p99_ms"] = float(np.quantile(queue, 0.99)) if queue.size else math.nan
    row["draft_length"] = draft_length
    rate = result.get("spec_decode_acceptance_rate")
    row["acceptance_length"] = _number(result.get("spec_decode_acceptance_length")) if draft_length else math.nan
    row["rejection_rate"] = 1.0 - float(rate) / 100.0 if draft_length and rate is not None else math.nan
    row["position_acceptance"] = [round_evidence(float(x)) for x in
                                  (result.get("spec_decode_per_position_acceptance_rates") or [])]
    row["kv_peak"] = _number(kv_peak)
    return {k: (round_evidence(v) if isinstance(v, float) else v) for k, v in row.items()}


def bucket_rows(result: Mapping, concurrency: int) -> dict[str, dict]:
    """Per bucket of one load run (``result["buckets"]`` names each request's), the two axes of the
    Pareto front: interactivity, 1000 / median TPOT of the bucket's requests, and throughput as a load
    of only that bucket would get at this concurrency, by Little's law (``concurrency`` requests in
    flight, each taking the bucket's mean latency): concurrency x mean output tokens / mean latency.

    >>> r = {"buckets": ["a", "b", "a"], "output_lens": [11, 5, 21], "latencies": [1.0, 0.5, 2.0],
    ...      "ttfts": [0.1, 0.1, 0.2], "errors": ["", "", ""]}
    >>> rows = bucket_rows(r, 2)
    >>> rows["a"]["output_tok_s"], rows["a"]["tpot_p50_ms"], rows["b"]["requests"]
    (21.3333, 90.0, 1)
    """
    columns = ("output_lens", "latencies", "ttfts")
    per: dict[str, list[tuple[float, float, float]]] = {}
    errors = result.get("errors") or [""] * len(result.get("buckets") or [])
    for bucket, error, *values in zip(result.get("buckets") or [], errors, *(result.get(c) or [] for c in columns)):
        out, latency, ttft = (float(v or 0.0) for v in values)
        if not error and out > 0 and latency > 0:  # a failed request has no latency to speak of
            per.setdefault(bucket, []).append((out, latency, ttft))
    rows = {}
    for bucket in sorted(per):
        out, latency, ttft = (np.array(x) for x in zip(*per[bucket]))
        decoding = out > 1
        tpot = (latency[decoding] - ttft[decoding]) / (out[decoding] - 1) * 1000.0
        rows[bucket] = {"requests": int(out.size),
                        "output_tok_s": round_evidence(concurrency * float(out.mean()) / float(latency.mean())),
                        "tpot_p50_ms": round_evidence(float(np.median(tpot))) if tpot.size else math.nan,
                        "tpot_p99_ms": round_evidence(float(np.quantile(tpot, 0.99))) if tpot.size else math.nan,
                        "ttft_p99_ms": round_evidence(float(np.quantile(ttft, 0.99)) * 1000.0),
                        "e2e_p99_ms": round_evidence(float(np.quantile(latency, 0.99)) * 1000.0)}
    return rows


def _slice_verdict(spec: Mapping, std: Mapping, policy: Policy) -> dict:
    """One concurrency: how the speculative path compares with the baseline, and what it breaches."""
    # a row as archived has None where a value was undefined (no request completed, no KV reading)
    spec, std = ({k: math.nan if v is None else v for k, v in row.items()} for row in (spec, std))
    throughput = ratio(spec["output_tok_s"], std["output_tok_s"])
    decode = ratio(std["tpot_p50_ms"], spec["tpot_p50_ms"])
    first_token = ratio(std["ttft_p50_ms"], spec["ttft_p50_ms"])
    breaches = []
    tolerance = policy.admission.latency_tolerance
    for tail in _TAILS:
        if spec[tail] > std[tail] * (1 + tolerance):
            breaches.append(f"{tail.removesuffix('_ms').replace('_', ' ')} {spec[tail]:.1f} ms over the "
                            f"baseline's {std[tail]:.1f} ms by more than {tolerance:.0%}")
    for tail, slo in (("e2e_p99_ms", policy.latency.e2e_p99_slo_ms), ("tpot_p99_ms", policy.latency.tpot_p99_slo_ms)):
        if slo is not None and spec[tail] > slo:
            breaches.append(f"{tail.removesuffix('_ms').replace('_', ' ')} {spec[tail]:.1f} ms over the SLO {slo:g} ms")
    spec_errors = ratio(spec["failed"], spec["failed"] + spec["completed"])
    std_errors = ratio(std["failed"], std["failed"] + std["completed"])
    if spec_errors > std_errors + policy.admission.error_tolerance:
        breaches.append(f"error rate {spec_errors:.1%} against the baseline's {std_errors:.1%}")
    if spec["kv_peak"] >= policy.kv.watermark:
        breaches.append(f"KV peak {spec['kv_peak']:.0%} at or past the watermark {policy.kv.watermark:.0%}")
    faster = throughput > policy.speedup.min_speedup
    return {"concurrency": spec["concurrency"], "throughput_ratio": round_evidence(throughput),
            "decode_speedup": round_evidence(decode), "ttft_speedup": round_evidence(first_token),
            "faster": bool(faster), "breaches": breaches, "pays": bool(faster and not breaches),
            "faster_part": ("decode and first token" if decode > 1 and first_token > 1 else "decode" if decode > 1
                            else "first token" if first_token > 1 else "neither")}


def _times(factor: float | None) -> str:
    return "n/a" if factor is None else f"{factor:.3g}x"


def judge_gate2(speculative: Sequence[Mapping], standard: Sequence[Mapping], policy: Policy) -> GateResult:
    """Pass when at least one concurrency pays (faster than the baseline by the policy's min speedup,
    no tail, SLO, error or KV breach); otherwise every slice's finding is a reason.

    >>> row = lambda c, tp, tpot: {"concurrency": c, "output_tok_s": tp, "tpot_p50_ms": tpot, "ttft_p50_ms": 10.0,
    ...     "ttft_p99_ms": 12.0, "tpot_p99_ms": tpot, "itl_p99_ms": tpot, "e2e_p99_ms": 100.0, "failed": 0,
    ...     "completed": 8, "kv_peak": 0.1}
    >>> g = judge_gate2([row(1, 50.0, 8.0)], [row(1, 100.0, 4.0)], Policy())
    >>> g.verdict
    'fail'
    >>> print(g.reasons[0])
    concurrency 1: not faster: output 0.5x the baseline (decode 0.5x, first token 1x); tpot p99 8.0 ms over the baseline's 4.0 ms by more than 10%, itl p99 8.0 ms over the baseline's 4.0 ms by more than 10%
    """
    by_concurrency = {row["concurrency"]: row for row in standard}
    slices = []
    for spec in sorted(speculative, key=lambda r: r["concurrency"]):
        std = by_concurrency.get(spec["concurrency"])
        if std is None:
            continue
        slices.append(_slice_verdict(spec, std, policy))
    reasons = []
    if not slices:
        reasons.append("no concurrency was measured on both paths")
    elif not any(s["pays"] for s in slices):
        for s in slices:
            what = ("faster" if s["faster"] else "not faster") + (
                f": output {_times(s['throughput_ratio'])} the baseline (decode {_times(s['decode_speedup'])}, "
                f"first token {_times(s['ttft_speedup'])})")
            reasons.append(f"concurrency {s['concurrency']}: {what}" + (f"; {', '.join(s['breaches'])}"
                                                                        if s["breaches"] else ""))
    return GateResult(verdict="fail" if reasons else "pass", reasons=reasons,
                      detail={"slices": slices, "speculative": list(speculative), "standard": list(standard)})
