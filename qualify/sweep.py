"""The sweep: draft-length candidates from the model's G, the throughput/interactivity Pareto front
of measured points, and the best D per batch-size range as vLLM's Dynamic SD table. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specwatch.detectors.draft_length import starting_draft_length, tile_draft_lengths

__all__ = ["SweepPoint", "draft_length_candidates", "dynamic_sd_table", "pareto_front", "sweep_cost"]


def draft_length_candidates(heads_per_kv: int | None, deployed: int, max_draft_length: int) -> list[int]:
    """The card's D, 128/G - 1, the tile boundaries where G x (1 + D) fills whole 128-row tiles, and
    each one's neighbours, up to ``max_draft_length`` (past it the starting point is named but capped).

    >>> draft_length_candidates(8, 4, 32)
    [3, 4, 5, 14, 15, 16, 30, 31, 32]
    >>> draft_length_candidates(2, 3, 4)  # G = 2 starts at D = 63: only what fits is measured
    [2, 3, 4]
    >>> draft_length_candidates(None, 2, 8)
    [1, 2, 3]
    """
    anchors = {deployed}
    if heads_per_kv:
        anchors.add(starting_draft_length(heads_per_kv))
        anchors.update(tile_draft_lengths(heads_per_kv, max_draft_length))
    candidates = {d + step for d in anchors for step in (-1, 0, 1)}
    return sorted(d for d in candidates if 1 <= d <= max_draft_length)


@dataclass(frozen=True)
class SweepPoint:
    """One measured configuration at one load: ``draft_length`` 0 is standard decoding."""

    mechanism: str
    draft_length: int
    concurrency: int
    output_tok_s: float  # throughput: every request's output tokens per second of wall time
    user_tok_s: float  # interactivity: one request's decode speed, 1000 / median TPOT
    ttft_p99_ms: float = float("nan")
    tpot_p99_ms: float = float("nan")
    bucket: str | None = None  # None: the whole dataset's load; a bucket: its requests within that load

    def as_dict(self) -> dict:
        out = {"mechanism": self.mechanism, "draft_length": self.draft_length, "concurrency": self.concurrency,
               "output_tok_s": round(self.output_tok_s, 3), "user_tok_s": round(self.user_tok_s, 3),
               "ttft_p99_ms": round(self.ttft_p99_ms, 3), "tpot_p99_ms": round(self.tpot_p99_ms, 3)}
        return out if self.bucket is None else dict(out, bucket=self.bucket)


def pareto_front(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The points no other point beats on both throughput and interactivity, by throughput.

    >>> p = [SweepPoint("draft_model", d, 4, tp, ui) for d, tp, ui in ((0, 10, 5), (2, 12, 6), (4, 14, 4), (6, 9, 3))]
    >>> [x.draft_length for x in pareto_front(p)]
    [2, 4]
    """
    front = [p for p in points
             if not any((q.output_tok_s >= p.output_tok_s and q.user_tok_s >= p.user_tok_s)
                        and (q.output_tok_s > p.output_tok_s or q.user_tok_s > p.user_tok_s) for q in points)]
    return sorted(front, key=lambda p: (p.output_tok_s, p.user_tok_s))


def dynamic_sd_table(points: Sequence[SweepPoint], mechanism: str, max_batch_size: int,
                     min_gain: float = 0.0) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: per batch-size range up to each measured
    concurrency, the D of ``mechanism`` with the highest throughput, or 0 where none beats standard
    decoding (D = 0 points) by more than ``min_gain``; equal neighbours merged.

    >>> pts = [SweepPoint("m", d, c, tp, 0) for d, c, tp in
    ...        ((0, 1, 10), (2, 1, 15), (4, 1, 17), (0, 4, 30), (2, 4, 33), (4, 4, 31), (0, 8, 50), (2, 8, 45))]
    >>> dynamic_sd_table(pts, "m", 16)
    [[1, 1, 4], [2, 4, 2], [5, 16, 0]]
    """
    concurrencies = sorted({p.concurrency for p in points})
    if not concurrencies:
        raise ValueError("no sweep point was measured: there is nothing to build a table from")
    rows: list[list[int]] = []
    start = 1
    for i, concurrency in enumerate(concurrencies):
        here = [p for p in points if p.concurrency == concurrency]
        baseline = max((p.output_tok_s for p in here if p.draft_length == 0), default=None)
        if baseline is None:
            raise ValueError(f"no standard-decoding point at concurrency {concurrency}: every D is judged against it")
        speculative = [p for p in here if p.mechanism == mechanism and p.draft_length > 0]
        best = max(speculative, key=lambda p: (p.output_tok_s, -p.draft_length), default=None)
        k = best.draft_length if best is not None and best.output_tok_s > baseline * (1 + min_gain) else 0
        end = max_batch_size if i == len(concurrencies) - 1 else concurrency
        if end < start:
            break
        if rows and rows[-1][2] == k:
            rows[-1][1] = end
        else:
            rows.append([start, end, k])
        start = end + 1
    return rows


def sweep_cost(engine_starts: int, load_runs: int, requests_per_run: int, gate1_requests: int,
               engine_start_s: float = 40.0, request_s: float = 0.5) -> dict:
    """What a run costs, stated before it starts: engine starts, load runs and requests, and a wall
    time from the seconds one engine start and one request take (defaults: a tiny model on 2 CPU cores).

    >>> sweep_cost(engine_starts=4, load_runs=6, requests_per_run=16, gate1_requests=40)
    {'engine_starts': 4, 'load_runs': 6, 'requests': 136, 'estimated_seconds': 228.0}
    """
    requests = load_runs * requests_per_run + gate1_requests
    return {"engine_starts": engine_starts, "load_runs": load_runs, "requests": requests,
            "estimated_seconds": round(engine_starts * engine_start_s + requests * request_s, 1)}
