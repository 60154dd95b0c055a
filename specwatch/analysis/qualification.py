"""A qualification report for people: the text `specwatch qualify` and `specwatch bundles show` print,
and the HTML page (Pareto front, AL per bucket, latency CDFs of both paths) `--html` writes."""

from __future__ import annotations

import html
import math
from typing import Mapping

__all__ = ["render_html", "render_text"]


def _num(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def render_text(report: Mapping) -> str:
    """The report as lines: verdicts and reasons first, then AL per bucket, the ledger and the sweep.

    >>> print(render_text({"bundle_id": "b-1", "verdict": "fail", "ts": 0.0, "card": {"drafter": {"mechanism":
    ...     "ngram", "draft_length": 2}}, "gate1": {"verdict": "pass", "reasons": [], "detail": {}},
    ...     "gate2": {"verdict": "fail", "reasons": ["concurrency 1: not faster"], "detail": {}}}))
    qualification of b-1: FAIL (ngram, D = 2)
    gate 1 (quality invariants): pass
    gate 2 (end-to-end ledger): fail
      - concurrency 1: not faster
    """
    drafter = report["card"].get("drafter", {})
    lines = [f"qualification of {report['bundle_id']}: {report['verdict'].upper()} "
             f"({drafter.get('mechanism')}, D = {drafter.get('draft_length')})"]
    for name, title in (("gate1", "gate 1 (quality invariants)"), ("gate2", "gate 2 (end-to-end ledger)")):
        gate = report[name]
        lines.append(f"{title}: {gate['verdict']}")
        lines += [f"  - {reason}" for reason in gate["reasons"]]
    detail1 = report["gate1"].get("detail") or {}
    if detail1:
        greedy, sampled = detail1["greedy"], detail1["sampled"]
        effect = sampled.get("effect_w")
        lines.append(f"  greedy: {greedy['identical']}/{greedy['requests']} identical; sampled: "
                     f"{sampled['requests'] - sampled['rejected']}/{sampled['requests']} equal in distribution "
                     f"(family alpha {sampled['alpha']:g}" + (f"; power stated at Cohen's w = {effect:g}" if effect
                                                              else "") + ")")
        for test in sampled["tests"]:
            ws = [p["detectable_w"] for p in test["per_position"] if "detectable_w" in p]
            verdict = ("differs" if test["rejected"] else "no difference found" if test.get("conclusive", True)
                       else "INCONCLUSIVE (no difference found, too little power)")
            lines.append(f"    {test['id']}: {verdict}; {test['draws'][0]} + {test['draws'][1]} draws, "
                         f"{test['positions_tested']} position(s) tested at level {test['level']:.2g}, "
                         + (f"power {test['power']:.2f} at w = {test['effect_w']:g}, detects w >= {min(ws):.2g} "
                            f"with power {sampled['power']:g}" if ws and "power" in test
                            else f"detects w >= {min(ws):.2g} with power {sampled['power']:g}" if ws
                            else "no position had enough distinct tokens to test: no power"))
        lines += [f"  {row['id']} ({row['bucket']}): {row['verdict']} ({row['prompt_tokens']} prompt + "
                  f"{row['max_tokens']} output tokens)" for row in detail1.get("skipped") or []]
        lines.append("  AL per bucket (mean, p10 / p50 / p90 of requests, rounds):")
        for bucket, al in detail1["acceptance"].items():
            lines.append(f"    {bucket:<14} {_num(al['mean'])}  {_num(al['p10'])} / {_num(al['p50'])} / "
                         f"{_num(al['p90'])}  ({al['rounds']} rounds)")
        for check in detail1["checks"]:
            lines.append(f"  check {check['check']} in {check['bucket']}: standard {check['standard_pass']}/"
                         f"{check['standard_runs']}, speculative {check['speculative_pass']}/{check['speculative_runs']}")
    detail2 = report["gate2"].get("detail") or {}
    if detail2.get("slices"):
        lines.append("  ledger (speculative vs standard, per concurrency):")
        std = {r["concurrency"]: r for r in detail2["standard"]}
        for row, verdict in zip(detail2["speculative"], detail2["slices"]):
            base = std[row["concurrency"]]
            lines.append(
                f"    c={row['concurrency']}: output {_num(row['output_tok_s'])} vs {_num(base['output_tok_s'])} tok/s "
                f"(x{_num(verdict['throughput_ratio'])}), TPOT p50 {_num(row['tpot_p50_ms'])} vs "
                f"{_num(base['tpot_p50_ms'])} ms, TTFT p50 {_num(row['ttft_p50_ms'])} vs {_num(base['ttft_p50_ms'])} ms, "
                f"p99 e2e {_num(row['e2e_p99_ms'])} vs {_num(base['e2e_p99_ms'])} ms, AL {_num(row['acceptance_length'])}, "
                f"KV peak {_num(row['kv_peak'])}, failed {row['failed']}; faster: {verdict['faster_part']}")
    sweep = report.get("sweep") or {}
    if sweep.get("pareto_by_bucket"):
        lines.append("  Pareto front per bucket (throughput / interactivity, tok/s; every configuration and load):")
        for bucket, front in sweep["pareto_by_bucket"].items():
            lines.append(f"    {bucket:<14} " + ", ".join(
                f"{p['mechanism']} D={p['draft_length']} c={p['concurrency']} {_num(p['output_tok_s'])}/"
                f"{_num(p['user_tok_s'])}" for p in front))
    if sweep.get("dynamic_sd"):
        dynamic = sweep["dynamic_sd"]
        lines.append(f"sweep: {len(sweep['points'])} points; Dynamic SD table ({dynamic['mechanism']}): "
                     f"{dynamic['table']} (vLLM validation: {dynamic['vllm_validation']})")
        if not dynamic["speculation_pays"]:
            lines.append("  D = 0 advised: speculation does not pay at any measured load")
        check = dynamic.get("engine_check")
        if check:
            lines.append(f"  engine with the table: {'started' if check['started'] else 'did not start'}"
                         + (f", {check['requests'] - check['failed']}/{check['requests']} requests completed"
                            if check["started"] else f": {check['error']}"))
    cost = report.get("cost") or {}
    if cost:
        lines.append(f"cost: {cost.get('engine_starts')} engine start(s), {cost.get('gate1_requests')} Gate 1 "
                     f"requests, {cost.get('load_requests')} load requests, {cost.get('wall_seconds')} s")
    return "\n".join(lines)


def _finish(fig, ax, ident: str, xlabel: str | None, ylabel: str) -> str:
    """Label and legend ``ax``, then ``fig`` as inline SVG (the figure closed)."""
    from specwatch.analysis.timeline import inline_svg
    import matplotlib.pyplot as plt

    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    svg = inline_svg(fig, ident)
    plt.close(fig)
    return svg


def _figure_pareto(report: Mapping) -> str:
    import specwatch.analysis.timeline  # noqa: F401  chooses matplotlib's Agg backend
    import matplotlib.pyplot as plt

    points = (report.get("sweep") or {}).get("points") or []
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    for concurrency in sorted({p["concurrency"] for p in points}):
        here = [p for p in points if p["concurrency"] == concurrency]
        ax.scatter([p["user_tok_s"] for p in here], [p["output_tok_s"] for p in here], label=f"concurrency {concurrency}")
        for p in here:
            ax.annotate(f"{p['mechanism'][:5]} D{p['draft_length']}", (p["user_tok_s"], p["output_tok_s"]), fontsize=6)
        front = report["sweep"]["pareto"].get(str(concurrency), [])
        ax.plot([p["user_tok_s"] for p in front], [p["output_tok_s"] for p in front], linestyle="--", linewidth=0.8)
    return _finish(fig, ax, "pareto", "interactivity (tok/s per request)", "throughput (output tok/s)")


def _figure_bucket_pareto(report: Mapping) -> str:
    """One panel per bucket: its points (configuration x concurrency) and its front."""
    import specwatch.analysis.timeline  # noqa: F401
    import matplotlib.pyplot as plt

    sweep = report.get("sweep") or {}
    points = sweep.get("bucket_points") or []
    buckets = sorted(sweep.get("pareto_by_bucket") or {})
    columns = min(3, max(1, len(buckets)))
    rows = max(1, -(-len(buckets) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.8 * rows), constrained_layout=True,
                             squeeze=False)
    for ax, bucket in zip(axes.flat, buckets):
        here = [p for p in points if p["bucket"] == bucket]
        for mechanism in sorted({p["mechanism"] for p in here}):
            mine = [p for p in here if p["mechanism"] == mechanism]
            ax.scatter([p["user_tok_s"] for p in mine], [p["output_tok_s"] for p in mine], s=12, label=mechanism)
        front = sweep["pareto_by_bucket"][bucket]
        ax.plot([p["user_tok_s"] for p in front], [p["output_tok_s"] for p in front], linestyle="--",
                linewidth=0.8, color="#555")
        ax.set_title(bucket, fontsize=8)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(buckets):]:
        ax.axis("off")
    return _finish(fig, axes.flat[0], "pareto-by-bucket", "interactivity (tok/s per request)",
                   "throughput (output tok/s)")


def _figure_acceptance(report: Mapping) -> str:
    import specwatch.analysis.timeline  # noqa: F401
    import matplotlib.pyplot as plt

    acceptance = (report["gate1"].get("detail") or {}).get("acceptance") or {}
    buckets = sorted(acceptance)
    fig, ax = plt.subplots(figsize=(6, 3), constrained_layout=True)
    means = [acceptance[b]["mean"] or 0.0 for b in buckets]
    low = [max(0.0, m - (acceptance[b]["p10"] or m)) for b, m in zip(buckets, means)]
    high = [max(0.0, (acceptance[b]["p90"] or m) - m) for b, m in zip(buckets, means)]
    ax.bar(buckets, means, yerr=[low, high], capsize=3, color="#2ca02c")
    ax.tick_params(axis="x", labelsize=7)
    return _finish(fig, ax, "acceptance", None, "acceptance length (mean, p10-p90)")


def _figure_latency(report: Mapping) -> str:
    import specwatch.analysis.timeline  # noqa: F401
    import matplotlib.pyplot as plt
    import numpy as np

    detail = report["gate2"].get("detail") or {}
    fig, ax = plt.subplots(figsize=(6, 3.4), constrained_layout=True)
    for path, style in (("standard", "-"), ("speculative", "--")):
        for row in detail.get(path) or []:
            samples = np.sort(np.array(row.get("e2e_samples_ms") or [], dtype=float))
            if samples.size:
                ax.step(samples, np.arange(1, samples.size + 1) / samples.size, linestyle=style, where="post",
                        label=f"{path} c={row['concurrency']}")
    return _finish(fig, ax, "latency-cdf", "end-to-end latency (ms)", "share of requests")


def render_html(report: Mapping) -> str:
    """A self-contained page: verdicts and reasons, the three figures, then the full text report."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>specwatch qualification {esc(report['bundle_id'])}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:1100px}"
        ".fail{color:#b03a2e;font-weight:600}.pass{color:#1e8449;font-weight:600}pre{font-size:.8rem}</style>"
        "</head><body>",
        f'<main id="qualification" data-bundle-id="{esc(report["bundle_id"])}" data-verdict="{esc(report["verdict"])}">',
        f"<h1>Qualification of <code>{esc(report['bundle_id'])}</code>: "
        f"<span class=\"{esc(report['verdict'])}\">{esc(report['verdict'])}</span></h1>",
    ]
    for name, title in (("gate1", "Gate 1: quality invariants"), ("gate2", "Gate 2: end-to-end ledger")):
        gate = report[name]
        parts.append(f'<h2 data-gate="{name}">{title}: <span class="{esc(gate["verdict"])}">{esc(gate["verdict"])}</span></h2>')
        if gate["reasons"]:
            parts.append("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in gate["reasons"]) + "</ul>")
    parts += ["<h2>Pareto front</h2>", f"<figure>{_figure_pareto(report)}</figure>",
              "<h2>Pareto front per bucket</h2>", f"<figure>{_figure_bucket_pareto(report)}</figure>",
              "<h2>Acceptance length per bucket</h2>", f"<figure>{_figure_acceptance(report)}</figure>",
              "<h2>Latency, both paths</h2>", f"<figure>{_figure_latency(report)}</figure>",
              "<h2>Report</h2>", f"<pre>{esc(render_text(report))}</pre>", "</main></body></html>"]
    return "\n".join(parts)
