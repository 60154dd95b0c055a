"""A qualification run: Gate 1 and Gate 2 on a bundle's server and a standard-decoding server of the
same target, then the D and mechanism sweep and the Dynamic SD table, into one `Qualification`.
Servers are passed in (URLs, or a factory that starts them); progress goes to a callback."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

from specwatch.schemas.contract import BundleCard
from specwatch.schemas.policy import Policy
from specwatch.schemas.qualification import GateResult, Qualification

from .client import count_prompt_tokens, run_requests
from .dataset import Dataset, context_overflow
from .gate1 import DEFAULT_ALPHA, DEFAULT_EFFECT_W, judge_gate1
from .gate2 import bucket_rows, judge_gate2, ledger_row
from .load import benchmark_run
from .sweep import SweepPoint, dynamic_sd_table, pareto_front, sweep_cost

__all__ = ["Endpoint", "QualifyPlan", "ServerFactory", "qualify_bundle", "speculative_config_at"]

_DEFAULT_CONCURRENCIES = (1, 4)
_DEFAULT_REQUESTS_PER_RUN = 16
_TABLE_CHECK_REQUESTS = 4


@dataclass(frozen=True)
class Endpoint:
    """A running OpenAI-compatible server: where it is, the model name it answers to, its tokenizer,
    and the longest sequence it holds (None when the server does not say)."""

    base_url: str
    model: str
    tokenizer: str
    max_model_len: int | None = None


ServerFactory = Callable[[dict], ContextManager[Endpoint]]
"""speculative_config -> a server of the same target with it, stopped when the context ends."""


@dataclass
class QualifyPlan:
    """What a run measures: concurrencies of Gate 2 and the sweep, and the sweep's configurations."""

    concurrencies: Sequence[int] = _DEFAULT_CONCURRENCIES
    requests_per_run: int = _DEFAULT_REQUESTS_PER_RUN
    draft_lengths: Sequence[int] = ()  # besides the card's own; each is one more engine start
    mechanisms: Sequence[str] = ()  # vLLM methods besides the card's, at each D ("ngram")
    max_batch_size: int = 8
    alpha: float = DEFAULT_ALPHA
    effect_w: float = DEFAULT_EFFECT_W  # the effect size the sampled tests' power is stated for
    check_table: bool = False  # start an engine with the Dynamic SD table and run requests on it
    gate2: bool = True  # False: Gate 1 only (a quick check of the lossless contract; the report fails)

    def sweep_configurations(self, method: str, draft_length: int) -> list[tuple[str, int]]:
        """(method, D) pairs to start servers for, beyond the card's own configuration."""
        lengths = sorted(set(self.draft_lengths) | {draft_length})
        return [(m, d) for m in [method, *[x for x in self.mechanisms if x != method]] for d in lengths
                if (m, d) != (method, draft_length)]


def speculative_config_at(config: dict, method: str, draft_length: int) -> dict:
    """The bundle's speculative_config moved to another D, or another mechanism at that D.

    >>> speculative_config_at({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}, "draft_model", 5)
    {'method': 'draft_model', 'model': '/d', 'num_speculative_tokens': 5}
    >>> speculative_config_at({"method": "draft_model", "model": "/d"}, "ngram", 2)
    {'method': 'ngram', 'num_speculative_tokens': 2, 'prompt_lookup_min': 2, 'prompt_lookup_max': 4}
    """
    if method == config.get("method"):
        return dict(config, num_speculative_tokens=draft_length)
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": draft_length, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    raise ValueError(f"cannot build a {method!r} drafter from the bundle's configuration: only its own "
                     "method at another D, or ngram, can be swept")


def _point(method: str, row: dict, bucket: str | None = None) -> SweepPoint:
    tpot = row["tpot_p50_ms"]
    return SweepPoint(method, row["draft_length"], row["concurrency"], row["output_tok_s"],
                      1000.0 / tpot if tpot and tpot == tpot else 0.0, row["ttft_p99_ms"], row["tpot_p99_ms"],
                      bucket=bucket)


def _points(method: str, rows: list[dict]) -> list[SweepPoint]:
    """One point per ledger row over all buckets, and one per bucket of each row."""
    return [_point(method, r) for r in rows] + [
        _point(method, dict(values, draft_length=r["draft_length"], concurrency=r["concurrency"]), bucket)
        for r in rows for bucket, values in (r.get("buckets") or {}).items()]


def _ledger(endpoint: Endpoint, dataset: Dataset, plan: QualifyPlan, draft_length: int,
            progress: Callable[[str], None], label: str) -> list[dict]:
    rows = []
    for concurrency in plan.concurrencies:
        started = time.monotonic()
        result, kv_peak = benchmark_run(endpoint.base_url, endpoint.model, endpoint.tokenizer, dataset.requests,
                                        concurrency, max(plan.requests_per_run, concurrency))
        row = ledger_row(result, concurrency, draft_length, kv_peak)
        row["e2e_samples_ms"] = [round(x * 1000.0, 3) for x in result.get("latencies") or []]
        row["buckets"] = bucket_rows(result, concurrency)
        rows.append(row)
        progress(f"{label}: concurrency {concurrency}: {row['completed']} completed, {row['failed']} failed, "
                 f"{row['output_tok_s']} output tok/s, TPOT p50 {row['tpot_p50_ms']} ms "
                 f"({time.monotonic() - started:.1f} s)")
    return rows


def qualify_bundle(card: BundleCard, speculative_config: dict, dataset: Dataset, policy: Policy,
                   speculative: Endpoint, standard: Endpoint, plan: QualifyPlan,
                   start_server: ServerFactory | None = None, progress: Callable[[str], None] = lambda _: None,
                   clock: Callable[[], float] = time.time, engine_starts: int = 0,
                   after_gates: Callable[[], None] = lambda: None) -> Qualification:
    """Gate 1, Gate 2 and the sweep for ``card`` (served by ``speculative``, with ``speculative_config``)
    against ``standard``; ``start_server`` makes the sweep's other configurations (without it only the
    card's D is measured). ``engine_starts`` counts servers the caller started for the two paths;
    ``after_gates`` is called when the two servers are no longer needed (before the sweep starts more)."""
    started = time.monotonic()
    dataset = _fitting(dataset, (standard, speculative), progress)
    method = speculative_config.get("method", "draft_model")
    draft_length = card.drafter.draft_length
    configurations = plan.sweep_configurations(method, draft_length) if start_server and plan.gate2 else []
    gate1_requests = 2 * sum(r.sampling.samples for r in dataset.requests)
    cost = sweep_cost(engine_starts + len(configurations) + int(plan.check_table),
                      (2 + len(configurations)) * len(plan.concurrencies), plan.requests_per_run, gate1_requests)
    progress(f"plan: Gate 1 {gate1_requests} requests on 2 paths; Gate 2 and sweep {cost['load_runs']} load runs "
             f"(concurrency {', '.join(map(str, plan.concurrencies))}; {len(configurations)} more configuration(s)); "
             f"{cost['engine_starts']} engine start(s), {cost['requests']} requests; about "
             f"{cost['estimated_seconds']:.0f} s for a tiny model on 2 CPU cores, more for a real model")

    def requests_progress(label):
        return lambda done, total: progress(f"gate 1 {label}: {done}/{total} requests")

    completions = []
    for label, endpoint in (("standard", standard), ("speculative", speculative)):
        completions += run_requests(endpoint.base_url, endpoint.model, label, dataset.requests,
                                    progress=requests_progress(label))
    gate1 = judge_gate1(dataset.requests, completions, plan.alpha, effect_w=plan.effect_w, skipped=dataset.skipped)
    progress(f"gate 1: {gate1.verdict}" + (f" ({len(gate1.reasons)} finding(s))" if gate1.reasons else ""))

    if not plan.gate2:
        after_gates()
        gate2 = GateResult(verdict="not_run", reasons=["not run: Gate 1 only was asked for"])
        return Qualification.for_card(card, ts=clock(), gate1=gate1, gate2=gate2, dataset=dataset.summary(),
                                      cost={"engine_starts": engine_starts, "gate1_requests": len(completions),
                                            "load_requests": 0, "wall_seconds": round(time.monotonic() - started, 1),
                                            "estimate": cost})
    std_rows = _ledger(standard, dataset, plan, 0, progress, "gate 2 standard")
    spec_rows = _ledger(speculative, dataset, plan, draft_length, progress, "gate 2 speculative")
    gate2 = judge_gate2(spec_rows, std_rows, policy)
    progress(f"gate 2: {gate2.verdict}")
    after_gates()

    points = _points("standard", std_rows) + _points(method, spec_rows)
    starts = engine_starts
    for other_method, d in configurations:
        progress(f"sweep: starting {other_method} D={d}")
        with start_server(speculative_config_at(speculative_config, other_method, d)) as endpoint:
            starts += 1
            points += _points(other_method, _ledger(endpoint, dataset, plan, d, progress,
                                                    f"sweep {other_method} D={d}"))
    sweep = _sweep_report(points, method, plan)
    if plan.check_table and start_server is not None:
        sweep["dynamic_sd"]["engine_check"] = _check_table(
            speculative_config, sweep["dynamic_sd"]["table"], dataset, start_server, progress)
        starts += 1
    return Qualification.for_card(
        card, ts=clock(), gate1=gate1, gate2=gate2, sweep=sweep, dataset=dataset.summary(),
        cost={"engine_starts": starts, "gate1_requests": len(completions),
              "load_requests": sum(r["completed"] + r["failed"] for r in std_rows + spec_rows),
              "wall_seconds": round(time.monotonic() - started, 1), "estimate": cost})


def _fitting(dataset: Dataset, endpoints: Sequence[Endpoint], progress: Callable[[str], None]) -> Dataset:
    """The dataset without the requests the servers cannot hold (prompt plus output beyond the
    smaller max_model_len of the two), each kept with its own verdict instead of failing on both paths."""
    limits = [e.max_model_len for e in endpoints if e.max_model_len]
    if not limits:
        return dataset
    limit = min(limits)
    skipped = context_overflow(dataset.requests, count_prompt_tokens(endpoints[0].base_url, endpoints[0].model,
                                                                     dataset.requests), limit)
    for row in skipped:
        progress(f"{row['id']} ({row['bucket']}): {row['verdict']} ({row['prompt_tokens']} prompt + "
                 f"{row['max_tokens']} output tokens)")
    return dataset.without(skipped)


def _sweep_report(points: list[SweepPoint], method: str, plan: QualifyPlan) -> dict:
    """Pareto fronts (per concurrency over all buckets; per bucket over every configuration and
    concurrency) and the Dynamic SD table of the bundle's mechanism, checked by vLLM."""
    overall = [p for p in points if p.bucket is None]
    by_bucket = [p for p in points if p.bucket is not None]
    fronts = {str(c): [p.as_dict() for p in pareto_front([p for p in overall if p.concurrency == c])]
              for c in sorted({p.concurrency for p in overall})}
    bucket_fronts = {b: [p.as_dict() for p in pareto_front([p for p in by_bucket if p.bucket == b])]
                     for b in sorted({p.bucket for p in by_bucket})}
    table = dynamic_sd_table(overall, method, plan.max_batch_size)
    advised = {f"{start}-{end}": k for start, end, k in table}
    return {"points": [p.as_dict() for p in overall], "pareto": fronts,
            "bucket_points": [p.as_dict() for p in by_bucket], "pareto_by_bucket": bucket_fronts,
            "dynamic_sd": {"mechanism": method, "table": table, "vllm_validation": _vllm_validation(table),
                           "advised_draft_length": advised,
                           "speculation_pays": any(k > 0 for _, _, k in table)}}


def _vllm_validation(table: list[list[int]]) -> str:
    """'ok' when vLLM's own schedule validation accepts ``table``, else its message."""
    try:
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
    except ImportError as error:
        return f"not checked: vLLM not importable ({error})"
    try:
        validate_and_normalize_dynamic_sd_schedule(table)
    except ValueError as error:
        return str(error)
    return "ok"


def _check_table(config: dict, table: list[list[int]], dataset: Dataset, start_server: ServerFactory,
                 progress: Callable[[str], None]) -> dict:
    """Start the bundle with the table as its Dynamic SD schedule and complete a few requests on it."""
    # vLLM wants a positive D as the schedule's ceiling, even where the table turns speculation off
    ceiling = max([config.get("num_speculative_tokens", 1), *(k for _, _, k in table)])
    dynamic = dict(config, num_speculative_tokens=ceiling, num_speculative_tokens_per_batch_size=table)
    progress(f"dynamic SD: starting an engine with {table}")
    requests = [r for r in dataset.requests if r.sampling.greedy][:_TABLE_CHECK_REQUESTS]
    try:
        with start_server(dynamic) as endpoint:
            done = run_requests(endpoint.base_url, endpoint.model, "speculative", requests)
    except Exception as error:  # the engine's own refusal is the finding here
        return {"started": False, "error": f"{type(error).__name__}: {error}"[:500], "config": dynamic}
    failed = [c.error for c in done if c.error]
    return {"started": True, "requests": len(done), "failed": len(failed), "errors": failed[:3], "config": dynamic}
