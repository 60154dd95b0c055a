"""matplotlib pictures: the demo's timeline, and figures as inline SVG for the HTML pages."""

from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

__all__ = ["inline_svg", "render_timeline"]

_ACTION_COLORS = {"disable_speculation": "#c0392b", "invalidate_bundle": "#8e44ad",
                  "reduce_draft_length": "#e67e22", "alert": "#7f8c8d", "restore": "#27ae60",
                  "promote": "#2980b9"}


def render_timeline(rows: list[dict], decisions: list, path: str | Path, cohort: str = "main",
                    incidents: list | None = None, title: str = "specwatch timeline") -> Path:
    """Draw AL and e2e p99 per bucket over event time, with decision markers; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    t0 = min((r["ts"] for r in rows), default=0.0)
    for row in rows:
        if row.get("bucket") is None or row.get("cohort") != cohort:
            continue
        series[row["bucket"]].append((row["ts"] - t0, row["acceptance_length"], row["e2e_p99"]))
    fig, (ax_al, ax_p99) = plt.subplots(2, 1, figsize=(15, 7), sharex=True, constrained_layout=True)
    for bucket in sorted(series):
        points = sorted(series[bucket])
        xs = [p[0] for p in points]
        ax_al.plot(xs, _smooth([p[1] for p in points], 5), label=bucket, linewidth=1.2)
        ax_p99.plot(xs, _smooth([p[2] for p in points], 10), label=bucket, linewidth=1.2)
    # Labels are numbered on the plot and spelled out in a legend box: decisions come in
    # bursts (one per cohort), and rotated text on top of each other cannot be read.
    legend_lines = []
    for number, decision in enumerate(decisions, start=1):
        x = decision.ts - t0
        color = _ACTION_COLORS.get(decision.action, "black")
        for ax in (ax_al, ax_p99):
            ax.axvline(x, color=color, linestyle="--", linewidth=1.0, alpha=0.8)
        ax_al.annotate(str(number), (x, 1.0 - 0.06 * ((number - 1) % 4)), xycoords=("data", "axes fraction"),
                       fontsize=7, va="top", ha="center", color="white",
                       bbox={"boxstyle": "circle,pad=0.2", "fc": color, "ec": "none"})
        scope = f"{decision.bucket or '*'}/{decision.cohort or '*'}"
        legend_lines.append(f"{number}. t={x:.0f}s {decision.action.replace('_', ' ')}: {decision.reason} {scope}")
    if legend_lines:
        ax_p99.text(1.01, 1.0, "\n".join(legend_lines), transform=ax_p99.transAxes, fontsize=7, va="top",
                    ha="left", family="monospace")
    for incident in incidents or ():
        ax_al.axvline(incident.start_ts - t0, color="black", linestyle=":", linewidth=0.8, alpha=0.5)
    ax_al.set_ylabel("acceptance length (tokens/round)")
    ax_p99.set_ylabel("e2e p99 (ms, 1 s windows)")
    ax_p99.set_xlabel("event time (s)")
    ax_al.set_title(f"{title} — cohort '{cohort}'; dashed: decisions, dotted: incident starts")
    ax_al.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="bucket")
    ax_p99.set_yscale("log")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
