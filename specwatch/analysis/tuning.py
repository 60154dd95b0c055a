"""Draft-length advice per bucket from archived window stats: the report `specwatch tune` prints."""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from typing import Mapping, Sequence

from specwatch.actions.flags import FlagStore
from specwatch.detectors.draft_length import (MECHANISM_COST, DraftLengthCurve, PositionSurvival, StepCost,
                                              draft_length_curve, starting_draft_length, tile_draft_lengths)
from specwatch.schemas.slice_stats import SliceStats, merge_all, round_evidence as _round

__all__ = ["DEFAULT_WINDOW_SECONDS", "heads_per_kv_head", "qualification_tune_report", "render_html", "render_text",
           "tune_report"]

DEFAULT_WINDOW_SECONDS = 300.0
# Tile-boundary candidates are listed up to this D: past it a drafter's acceptance is spent.
_MAX_TILE_CANDIDATE = 64
# More query heads than any model has; a larger count in a config is a mistake, not a model.
_MAX_HEADS = 1 << 16


def heads_per_kv_head(config: object) -> int:
    """G, query heads per KV head, from a Hugging Face model config (``config.json``); ValueError
    naming the field when a head count is missing, not a whole number from 1 up, or does not divide.

    >>> heads_per_kv_head({"num_attention_heads": 32, "num_key_value_heads": 8})
    4
    >>> heads_per_kv_head({"num_attention_heads": 12})  # no GQA: one KV head per query head
    1
    >>> heads_per_kv_head({"num_attention_heads": 32, "num_key_value_heads": 0})
    Traceback (most recent call last):
    ...
    ValueError: num_key_value_heads must be a whole number from 1 to 65536, got 0
    >>> heads_per_kv_head({"num_attention_heads": True})
    Traceback (most recent call last):
    ...
    ValueError: num_attention_heads must be a whole number from 1 to 65536, got true
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"the model config must be a JSON object (a config.json), not a JSON {_json_type(config)}")
    if "num_attention_heads" not in config:
        raise ValueError("the model config has no num_attention_heads: pass --heads-per-kv G instead")
    heads = _head_count(config, "num_attention_heads")
    kv = _head_count(config, "num_key_value_heads") if "num_key_value_heads" in config else heads
    if heads % kv:
        raise ValueError(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    return heads // kv


def _head_count(config: Mapping, name: str) -> int:
    value = config[name]
    # bool is an int in Python, and true / false are no head counts in JSON
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_HEADS:
        raise ValueError(f"{name} must be a whole number from 1 to {_MAX_HEADS}, got {_json_text(value)}")
    return value


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _json_text(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (bool, int, float, str, type(None))) else f"a JSON {_json_type(value)}"
    return text[:40]


def _slice(row: Mapping) -> SliceStats:
    """An archived window-stats row back as raw counts (step times were archived per step)."""
    s = SliceStats()
    s.steps, s.rounds, s.plain_entries = row["steps"], row["rounds"], row["plain_entries"]
    s.drafted_tokens, s.accepted_tokens = row["drafted_tokens"], row["accepted_tokens"]
    s.accepted_at_least, s.drafted_at_least = list(row["accepted_at_least"]), list(row["drafted_at_least"])
    if s.steps:
        s.draft_ms = row["draft_ms"] * s.steps if not math.isnan(row["draft_ms"]) else 0.0
        s.verify_ms = row["verify_ms"] * s.steps if not math.isnan(row["verify_ms"]) else 0.0
    return s


def tune_report(rows: Sequence[Mapping], card: Mapping, bundle_id: str, flags: FlagStore | None = None,
                heads_per_kv: int | None = None, window_seconds: float = DEFAULT_WINDOW_SECONDS) -> dict:
    """Per-bucket curves, best and current D, expected gain and warnings for one bundle, from the
    last ``window_seconds`` of its window-stats ``rows``; ``flags`` gives each bucket's D limit."""
    rows = [r for r in rows if r["bundle_id"] == bundle_id]
    newest = max((r["ts"] for r in rows), default=math.nan)
    recent = [r for r in rows if r["ts"] > newest - window_seconds]
    drafter = card.get("drafter") or {}
    mechanism, deployed = drafter.get("mechanism", "external"), int(drafter.get("draft_length") or 0)
    cost = StepCost.fit([_slice(r) for r in recent if r["bucket"] is None and r["cohort"] is None], mechanism)
    by_bucket: dict[str, list[Mapping]] = defaultdict(list)
    for r in recent:
        if r["bucket"] is not None:
            by_bucket[r["bucket"]].append(r)
    # 128/G - 1 is 0 from G = 128 on: one query group fills a tile, and there is no starting point
    start = (starting_draft_length(heads_per_kv) or None) if heads_per_kv else None
    tiles = tile_draft_lengths(heads_per_kv, _MAX_TILE_CANDIDATE) if heads_per_kv else None
    buckets = []
    for bucket in sorted(by_bucket):
        bucket_rows = by_bucket[bucket]
        survival = PositionSurvival.from_stats(merge_all((_slice(r) for r in bucket_rows), sketches=False))
        curve = draft_length_curve(survival, cost)
        current = _current_draft_length(bucket_rows, bundle_id, bucket, deployed, flags)
        buckets.append(_bucket_report(bucket, curve, current, start, tiles))
    return {
        "bundle_id": bundle_id,
        "mechanism": mechanism,
        "deployed_draft_length": deployed,
        "window": {"start": newest - window_seconds if rows else None, "end": newest if rows else None,
                   "seconds": window_seconds},
        "heads_per_kv_head": heads_per_kv,
        "starting_draft_length": start,
        "step_cost": cost.to_dict(),
        "buckets": buckets,
    }


def qualification_tune_report(qualification: Mapping, heads_per_kv: int | None = None) -> dict:
    """The same report from a qualification instead of traffic: each bucket's per-position acceptance
    counts from Gate 1, and a step cost from Gate 2's ledger at its lowest concurrency (one D was
    measured, so every drafted token carries its share of draft and verify time alike)."""
    card = qualification["card"]
    drafter = card.get("drafter") or {}
    mechanism, deployed = drafter.get("mechanism", "external"), int(drafter.get("draft_length") or 0)
    acceptance = ((qualification.get("gate1") or {}).get("detail") or {}).get("acceptance") or {}
    cost = _ledger_step_cost(((qualification.get("gate2") or {}).get("detail") or {}), mechanism, deployed)
    start = (starting_draft_length(heads_per_kv) or None) if heads_per_kv else None
    tiles = tile_draft_lengths(heads_per_kv, _MAX_TILE_CANDIDATE) if heads_per_kv else None
    buckets = []
    for bucket in sorted(acceptance):
        counts = acceptance[bucket]
        survival = PositionSurvival.from_counts(counts["accepted_at_least"], counts["drafted_at_least"])
        buckets.append(_bucket_report(bucket, draft_length_curve(survival, cost), deployed, start, tiles))
    return {
        "bundle_id": qualification["bundle_id"],
        "mechanism": mechanism,
        "deployed_draft_length": deployed,
        "source": {"qualification_ts": qualification.get("ts"), "verdict": qualification.get("verdict"),
                   "qualification_id": qualification.get("qualification_id")},
        "window": {"start": None, "end": None, "seconds": None},
        "heads_per_kv_head": heads_per_kv,
        "starting_draft_length": start,
        "step_cost": cost.to_dict(),
        "buckets": buckets,
    }


def _ledger_step_cost(ledger: Mapping, mechanism: str, draft_length: int) -> StepCost:
    """A step cost from one concurrency of both paths: a standard step is the baseline's median TPOT,
    a speculative step the speculative median TPOT x AL; their difference, per drafted token, is the
    cost of drafting one more token (NaN throughout when the ledger lacks either path)."""
    standard = {r["concurrency"]: r for r in ledger.get("standard") or []}
    rows = sorted((r for r in ledger.get("speculative") or [] if r["concurrency"] in standard),
                  key=lambda r: r["concurrency"])
    nan = math.nan
    standard_ms = spec_step_ms = nan
    if rows and draft_length:
        row = rows[0]
        standard_ms = _float(standard[row["concurrency"]].get("tpot_p50_ms"))
        spec_step_ms = _float(row.get("tpot_p50_ms")) * _float(row.get("acceptance_length"))
    extra = max(0.0, spec_step_ms - standard_ms) if spec_step_ms == spec_step_ms else nan
    kind = MECHANISM_COST.get(mechanism, "serial")
    per_token = extra / draft_length if draft_length else nan
    return StepCost(mechanism, kind, draft_per_step=extra if kind == "parallel" else 0.0,
                    draft_intercept=per_token if kind == "serial" else 0.0, draft_slope=0.0,
                    verify_intercept=standard_ms, verify_per_request=0.0, verify_per_draft_token=0.0,
                    requests_per_step=1.0, drafting_per_step=1.0, slices=len(rows[:1]), steps=0,
                    draft_fit="qualification_ledger", verify_fit="qualification_ledger")


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _current_draft_length(rows: Sequence[Mapping], bundle_id: str, bucket: str, deployed: int,
                          flags: FlagStore | None) -> int:
    """The D the bucket's busiest cohort drafts now: the card's, capped by decisions; 0 when off."""
    rounds: dict[str, int] = defaultdict(int)
    for r in rows:
        rounds[r["cohort"]] += r["rounds"]
    cohort = max(sorted(rounds, key=str), key=lambda c: rounds[c], default=None)
    if flags is None or cohort is None:
        return deployed
    state = flags.lookup(bundle_id, bucket, cohort)
    if not state.enabled:
        return 0
    return deployed if state.draft_limit is None else min(deployed, state.draft_limit)


def _bucket_report(bucket: str, curve: DraftLengthCurve, current: int, start: int | None,
                   tiles: list[int] | None) -> dict:
    best = curve.best()
    best_d = best.draft_length if best is not None else None
    gain = curve.gain(best_d, current) if best_d and curve.point(current) else (math.nan,) * 3
    warning = None
    if curve.thin:
        warning = f"evidence too thin to advise: {curve.thin}"
    elif best_d is not None and best_d != current and curve.point(current) and gain[1] > 0:
        warning = (f"best D {best_d} differs from the deployed D {current} by more than the uncertainty: "
                   f"predicted gain {gain[0]:+.1%} (95% interval {gain[1]:+.1%} to {gain[2]:+.1%})")
    body = curve.to_dict()
    return {
        "bucket": bucket,
        "current_d": current,
        "best_d": best_d,
        "expected_gain": _round(gain[0]),
        "expected_gain_interval": [_round(gain[1]), _round(gain[2])],
        "warning": warning,
        "starting_d": start,
        "tile_candidates": tiles,
        "rounds": body["rounds"],
        "position_rates": body["position_rates"],
        "position_intervals": body["position_intervals"],
        "curve": [{"d": p["draft_length"], "acceptance_length": p["acceptance_length"],
                   "acceptance_interval": [p["acceptance_low"], p["acceptance_high"]],
                   "speedup": p["speedup"], "speedup_interval": [p["speedup_low"], p["speedup_high"]],
                   "draft_ms": p["draft_ms"], "verify_ms": p["verify_ms"]} for p in body["points"]],
    }


def _starting_point(report: Mapping) -> str:
    if report["starting_draft_length"] is None:
        return "no starting point (128/G - 1 < 1: one query group fills a 128-row tile)"
    return f"starting point 128/G - 1 = {report['starting_draft_length']}"


def render_text(report: Mapping) -> str:
    """The report as a few lines per bucket."""
    lines = [f"bundle {report['bundle_id']} ({report['mechanism']}, deployed D {report['deployed_draft_length']})"]
    if report.get("source"):
        lines.append(f"from the qualification of {_when(report['source']['qualification_ts'])} "
                     f"({report['source']['verdict']}): Gate 1's acceptance per position, Gate 2's step times")
    if report["heads_per_kv_head"]:
        lines.append(f"G = {report['heads_per_kv_head']} query heads per KV head: {_starting_point(report)}")
    else:
        lines.append("G unknown (pass --model-config or --heads-per-kv): no starting point or tile candidates")
    for b in report["buckets"]:
        gain = "" if b["expected_gain"] is None else f", expected gain {b['expected_gain']:+.1%}"
        lines.append(f"\n{b['bucket']}: best D {b['best_d']}, current D {b['current_d']}{gain} "
                     f"({b['rounds']} rounds)")
        lines.append("   D    AL (95% interval)        speedup (95% interval)")
        for p in b["curve"]:
            marks = "".join(m for m, d in (("*", b["best_d"]), ("<", b["current_d"])) if d == p["d"])
            lines.append(f"  {p['d']:2d}  {_num(p['acceptance_length'])} ({_num(p['acceptance_interval'][0])}-"
                         f"{_num(p['acceptance_interval'][1])})   {_num(p['speedup'])} ({_num(p['speedup_interval'][0])}-"
                         f"{_num(p['speedup_interval'][1])}) {marks}")
        if b["tile_candidates"] is not None:
            lines.append(f"  tile-boundary D (G x (1+D) a multiple of 128): "
                         f"{', '.join(map(str, b['tile_candidates'])) or 'none up to 64'}")
        if b["warning"]:
            lines.append(f"  warning: {b['warning']}")
    if not report["buckets"]:
        lines.append("no speculative acceptance in the qualification" if report.get("source")
                     else "no speculative window stats for this bundle in the window")
    return "\n".join(lines)


def _when(ts) -> str:
    import datetime

    return "-" if ts is None else datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _plot_svg(bucket: Mapping) -> str:
    """The bucket's speedup and AL curves with their intervals, best and current D: inline SVG."""
    from specwatch.analysis.timeline import inline_svg  # chooses matplotlib's Agg backend
    import matplotlib.pyplot as plt

    points = [p for p in bucket["curve"] if p["speedup"] is not None]
    ds = [p["d"] for p in points]
    fig, (ax_s, ax_al) = plt.subplots(1, 2, figsize=(9, 3.2), constrained_layout=True)
    if points:
        ax_s.plot(ds, [p["speedup"] for p in points], marker="o", color="#1f77b4", label="predicted speedup")
        ax_s.fill_between(ds, [p["speedup_interval"][0] for p in points], [p["speedup_interval"][1] for p in points],
                          color="#1f77b4", alpha=0.2, label="95% interval")
        ax_al.plot(ds, [p["acceptance_length"] for p in points], marker="o", color="#2ca02c", label="predicted AL")
        ax_al.fill_between(ds, [p["acceptance_interval"][0] for p in points],
                           [p["acceptance_interval"][1] for p in points], color="#2ca02c", alpha=0.2)
    for ax in (ax_s, ax_al):
        if bucket["best_d"]:
            ax.axvline(bucket["best_d"], color="#d62728", linestyle="--", label=f"best D {bucket['best_d']}")
        if bucket["current_d"]:
            ax.axvline(bucket["current_d"], color="#7f7f7f", linestyle=":", label=f"current D {bucket['current_d']}")
        ax.set_xlabel("draft length D")
        ax.set_xticks(ds or [1])
    ax_s.set_ylabel("speedup over standard decoding")
    ax_al.set_ylabel("acceptance length (tokens per round)")
    ax_s.legend(fontsize=7)
    ax_s.set_title(f"{bucket['bucket']}: speedup", fontsize=9)
    ax_al.set_title(f"{bucket['bucket']}: acceptance length", fontsize=9)
    svg = inline_svg(fig)
    plt.close(fig)
    return svg


def render_html(report: Mapping) -> str:
    """A self-contained page: per bucket the plotted curve, the table, the candidates and warnings.

    >>> page = render_html({"bundle_id": "b-1", "mechanism": "eagle3", "deployed_draft_length": 4,
    ...                     "heads_per_kv_head": None, "starting_draft_length": None, "buckets": []})
    >>> page.startswith("<!DOCTYPE html>"), 'data-bundle-id="b-1"' in page
    (True, True)
    """
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>specwatch tune {esc(report['bundle_id'])}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:1100px}"
        "table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #ddd;padding:.2rem .5rem}"
        "th{background:#f5f5f5}.warning{color:#b03a2e;font-weight:600}.muted{color:#777}</style></head><body>",
        f'<main id="tune" data-bundle-id="{esc(report["bundle_id"])}">',
        f"<h1>Draft length for bundle <code>{esc(report['bundle_id'])}</code></h1>",
        f'<p id="summary">drafter {esc(str(report["mechanism"]))}, deployed D {report["deployed_draft_length"]}; '
        + (f"G = {report['heads_per_kv_head']}, {_starting_point(report)}"
           if report["heads_per_kv_head"] else "G unknown: no starting point or tile candidates") + "</p>",
    ]
    for b in report["buckets"]:
        parts.append(f'<section class="bucket" data-bucket="{esc(b["bucket"])}" data-best-d="{b["best_d"]}" '
                     f'data-current-d="{b["current_d"]}">')
        parts.append(f"<h2>{esc(b['bucket'])}</h2>")
        gain = "" if b["expected_gain"] is None else f"; expected gain <span class=\"gain\">{b['expected_gain']:+.1%}</span>"
        parts.append(f"<p>best D <b class=\"best-d\">{b['best_d']}</b>, current D "
                     f"<b class=\"current-d\">{b['current_d']}</b>{gain} ({b['rounds']} rounds)</p>")
        if b["warning"]:
            parts.append(f'<p class="warning">{esc(b["warning"])}</p>')
        parts.append(f'<figure class="curve">{_plot_svg(b)}</figure>')
        parts.append("<table><tr><th>D</th><th>AL</th><th>AL 95%</th><th>speedup</th><th>speedup 95%</th></tr>")
        for p in b["curve"]:
            parts.append(f'<tr data-d="{p["d"]}"><td>{p["d"]}</td><td>{_num(p["acceptance_length"])}</td>'
                         f'<td>{_num(p["acceptance_interval"][0])} to {_num(p["acceptance_interval"][1])}</td>'
                         f'<td class="speedup">{_num(p["speedup"])}</td>'
                         f'<td>{_num(p["speedup_interval"][0])} to {_num(p["speedup_interval"][1])}</td></tr>')
        parts.append("</table>")
        if b["tile_candidates"] is not None:
            parts.append(f'<p class="tiles">tile-boundary D: {esc(", ".join(map(str, b["tile_candidates"])) or "none")}</p>')
        parts.append("</section>")
    if not report["buckets"]:
        parts.append('<p class="muted">No speculative window stats for this bundle in the window.</p>')
    parts.append(f'<script type="application/json" id="report">{esc(json.dumps(report, sort_keys=True))}</script>')
    parts.append("</main></body></html>")
    return "\n".join(parts)
