"""matplotlib pictures: the demo's timeline, and figures as inline SVG for the HTML pages."""

from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

from specwatch.outputs import save_figure

__all__ = ["SIGNAL_OF_INCIDENT", "inline_svg", "render_timeline"]

_ACTION_COLORS = {"disable_speculation": "#c0392b", "invalidate_bundle": "#8e44ad",
                  "reduce_draft_length": "#e67e22", "alert": "#7f8c8d", "restore": "#27ae60",
                  "promote": "#2980b9"}


# The signal each incident kind moves, by the panel that draws it.
SIGNAL_OF_INCIDENT = {"acceptance_drop": "acceptance", "target_update": "acceptance",
                      "late_acceptance_decay": "acceptance", "latency_tail": "latency",
                      "error_burst": "errors", "kv_pressure": "kv", "context_shift": "kv",
                      "quality_mismatch": "shadow", "draft_regression": "draft",
                      "draft_cost_doubles": "draft"}
# Trailing slices an error rate is read over: single slices of a few requests are 0 or 1.
_ERROR_SLICES = 10


def render_timeline(rows: list[dict], decisions: list, path: str | Path, cohort: str = "main",
                    incidents: list | None = None, title: str = "specwatch timeline",
                    shadow_mismatches: dict[str, list[float]] | None = None,
                    kv_watermark: float | None = None) -> Path:
    """Draw, over event time, every signal the ``incidents`` move: AL and e2e p99 per bucket (of
    ``cohort``), the error rate per bucket (speculative cohorts), the bundle's KV peak against
    ``kv_watermark``, strict shadow mismatches per bucket (``shadow_mismatches``: their event
    times), draft cost; with decision markers. Panels no incident moves (beyond AL and p99) are
    left out. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = min((r["ts"] for r in rows), default=0.0)
    wanted = {SIGNAL_OF_INCIDENT.get(i.kind) for i in incidents or ()}
    panels = ["acceptance", "latency"] + [name for name in ("errors", "kv", "shadow", "draft") if name in wanted]
    fig, axes = plt.subplots(len(panels), 1, figsize=(15, 2.6 * len(panels) + 1.8), sharex=True,
                             constrained_layout=True)
    ax = dict(zip(panels, axes))
    series = _bucket_series(rows, t0, cohort)
    for bucket in sorted(series):
        points = series[bucket]
        xs = [p[0] for p in points]
        ax["acceptance"].plot(xs, _smooth([p[1] for p in points], 5), label=bucket, linewidth=1.2)
        ax["latency"].plot(xs, _smooth([p[2] for p in points], 10), label=bucket, linewidth=1.2)
    if "errors" in ax:
        for bucket, (xs, rates) in sorted(_error_rates(rows, t0).items()):
            ax["errors"].plot(xs, [r * 100.0 for r in rates], label=bucket, linewidth=1.2)
        ax["errors"].set_ylabel(f"errors + timeouts\n(%, {_ERROR_SLICES} s, all cohorts)")
    if "kv" in ax:
        kv = sorted((r["ts"] - t0, r["kv_peak"]) for r in rows if r.get("bucket") is None and r["steps"])
        ax["kv"].plot([p[0] for p in kv], [p[1] for p in kv], color="#34495e", linewidth=1.0, label="bundle")
        if kv_watermark is not None:
            ax["kv"].axhline(kv_watermark, color="#c0392b", linewidth=0.8, label=f"watermark {kv_watermark:g}")
        ax["kv"].set_ylabel("KV usage, peak\nper 1 s (bundle)")
        ax["kv"].legend(loc="lower left", fontsize=7)
    if "shadow" in ax:
        for bucket, times in sorted((shadow_mismatches or {}).items()):
            xs = sorted(t - t0 for t in times)
            # one mismatch decides: every one is a marker, the step shows how they add up
            ax["shadow"].step(xs, range(1, len(xs) + 1), where="post", label=bucket, linewidth=1.2, marker="o",
                              markersize=4)
        ax["shadow"].set_ylabel("strict shadow\nmismatches (count)")
    if "draft" in ax:
        cost = sorted((r["ts"] - t0, r["draft_ms"] / r["verify_ms"]) for r in rows
                      if r.get("bucket") is None and r["steps"] and r["verify_ms"])
        ax["draft"].plot([p[0] for p in cost], _smooth([p[1] for p in cost], 5), color="#34495e", linewidth=1.0)
        ax["draft"].set_ylabel("draft ms per\nverify ms (bundle)")
    # Labels are numbered on the plot and spelled out in a legend box: decisions come in
    # bursts (one per cohort), and rotated text on top of each other cannot be read.
    legend_lines = []
    top = axes[0]
    for number, decision in enumerate(decisions, start=1):
        x = decision.ts - t0
        color = _ACTION_COLORS.get(decision.action, "black")
        for axis in axes:
            axis.axvline(x, color=color, linestyle="--", linewidth=1.0, alpha=0.8)
        top.annotate(str(number), (x, 1.0 - 0.06 * ((number - 1) % 4)), xycoords=("data", "axes fraction"),
                     fontsize=7, va="top", ha="center", color="white",
                     bbox={"boxstyle": "circle,pad=0.2", "fc": color, "ec": "none"})
        scope = f"{decision.bucket or '*'}/{decision.cohort or '*'}"
        legend_lines.append(f"{number}. t={x:.0f}s {decision.action.replace('_', ' ')}: {decision.reason} {scope}")
    if legend_lines:
        axes[1].text(1.01, 1.0, "\n".join(legend_lines), transform=axes[1].transAxes, fontsize=7, va="top",
                     ha="left", family="monospace")
    for incident in incidents or ():
        x = incident.start_ts - t0
        for axis in axes:
            axis.axvline(x, color="black", linestyle=":", linewidth=0.8, alpha=0.5)
        panel = ax.get(SIGNAL_OF_INCIDENT.get(incident.kind, ""), top)
        panel.annotate(incident.kind, (x, 0.02), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                       va="bottom", ha="right", color="black", alpha=0.7)
    ax["acceptance"].set_ylabel("acceptance length\n(tokens/round)")
    ax["latency"].set_ylabel("e2e p99\n(ms, 1 s windows)")
    axes[-1].set_xlabel("event time (s)")
    top.set_title(f"{title} — AL and p99: cohort '{cohort}'; dashed: decisions, dotted: incident starts")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="bucket")
    ax["latency"].set_yscale("log")
    save_figure(fig, path)
    plt.close(fig)
    return path


def _bucket_series(rows: list[dict], t0: float, cohort: str) -> dict[str, list[tuple[float, float, float]]]:
    """Per bucket: (time, AL, e2e p99) of ``cohort``'s rows, in time order."""
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for row in rows:
        if row.get("bucket") is None or row.get("cohort") != cohort:
            continue
        series[row["bucket"]].append((row["ts"] - t0, row["acceptance_length"], row["e2e_p99"]))
    return {bucket: sorted(points) for bucket, points in series.items()}


def _error_rates(rows: list[dict], t0: float) -> dict[str, tuple[list[float], list[float]]]:
    """Per bucket, the failed share of its finished requests over the trailing ``_ERROR_SLICES``
    slices, while its cohorts speculate (after a fallback the speculative path's errors are gone).

    >>> rows = [{"ts": float(t), "bucket": "x", "cohort": "main", "speculation_on": True,
    ...          "requests": 10, "errors": 1 if t >= 10 else 0} for t in range(20)]
    >>> xs, rates = _error_rates(rows, 0.0)["x"]
    >>> rates[9], rates[14], rates[19]
    (0.0, 0.05, 0.1)
    """
    tallies: dict[str, dict[float, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for row in rows:
        if row.get("bucket") is None or not row.get("speculation_on") or not row["requests"]:
            continue
        tally = tallies[row["bucket"]][row["ts"] - t0]
        tally[0] += row["errors"]
        tally[1] += row["requests"]
    out = {}
    for bucket, by_time in tallies.items():
        xs = sorted(by_time)
        failed = [by_time[x][0] for x in xs]
        finished = [by_time[x][1] for x in xs]
        rates = []
        for i in range(len(xs)):
            lo = max(0, i - _ERROR_SLICES + 1)
            rates.append(sum(failed[lo:i + 1]) / sum(finished[lo:i + 1]))
        out[bucket] = (xs, rates)
    return out


def _smooth(values: list[float], width: int) -> list[float]:
    """Trailing mean over ``width`` points, skipping NaN, so the eye sees trends not noise."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - width + 1): i + 1] if v is not None and not math.isnan(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def inline_svg(figure, ident: str | None = None) -> str:
    """``figure`` as an ``<svg>`` element (text kept as text), with ``ident`` as its id."""
    out = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(out, format="svg")
    svg = out.getvalue()
    svg = svg[svg.index("<svg"):]
    return svg if ident is None else svg.replace("<svg ", f'<svg id="{ident}" ', 1)
