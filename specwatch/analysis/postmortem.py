"""Postmortem of one archived decision: a self-contained HTML page and a plain-text summary."""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
from typing import Iterable, Sequence

__all__ = ["PLOTS", "format_pairs", "render_html", "render_text", "sample_summary"]

# The evidence-window plots: (id, title, unit, [(series label, window field)]).
PLOTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("acceptance_length", "Acceptance length (tokens per round)", "", (("AL", "acceptance_length"),)),
    ("draft_overhead", "Draft overhead (share of step time)", "", (("draft share", "draft_overhead"),)),
    ("speedup", "Estimated speedup over standard decoding", "x", (("speedup", "speedup"),)),
    ("e2e_latency", "End-to-end latency", "ms", (("p50", "e2e_p50"), ("p95", "e2e_p95"), ("p99", "e2e_p99"))),
    ("tpot_latency", "Time per output token", "ms", (("p50", "tpot_p50"), ("p95", "tpot_p95"), ("p99", "tpot_p99"))),
    ("error_rate", "Error and timeout rate", "", (("errors", "error_rate"),)),
    ("mismatch_rate", "Shadow mismatch rate", "", (("mismatches", "mismatch_rate"),)),
    ("kv_peak", "KV cache peak usage", "", (("KV peak", "kv_peak"),)),
)
# The plot that carries the finding's threshold and baseline lines, by the finding's metric; other
# metrics (draft_to_verify, the tail tests' shares, shadow mismatches) are not in a plot's unit.
_METRIC_PLOT = {"acceptance_length": "acceptance_length", "estimated_speedup": "speedup",
                "e2e_p99_ms": "e2e_latency", "tpot_p99_ms": "tpot_latency",
                "error_rate": "error_rate", "kv_peak": "kv_peak"}
_MAX_SAMPLE_ROWS = 50

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem;color:#222;max-width:1150px}
h1{font-size:1.4rem;margin-bottom:.2rem} h2{font-size:1.1rem;margin-top:1.6rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85rem} td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left}
th{background:#f5f5f5} .plots{display:flex;flex-wrap:wrap;gap:1rem} figure{margin:0}
figcaption{font-size:.8rem;color:#555} .muted{color:#777} code{font-size:.85rem}
pre{font-size:.75rem;white-space:pre-wrap;margin:0}
""".strip()


def _audit(record: dict) -> dict:
    return record.get("audit") or {}


def _finding(record: dict) -> dict:
    detail = _audit(record).get("detail") or {}
    return detail.get("finding") or record.get("evidence") or {}


def _scope(record: dict) -> str:
    from specwatch.schemas.scope import scope_text  # loaded when shown: `specwatch --help` needs no pydantic

    return scope_text((record["bundle_id"], record.get("bucket"), record.get("cohort")))


def _utc(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        # four significant digits read well for ratios and milliseconds; big values keep every digit
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


# Evidence fields that hold event times (ts, window_end, learned_from...): shown as UTC.
_TIME_SUFFIXES = ("_ts", "_start", "_end", "_from", "_until", "_at")


def _shown(key: str, value) -> str:
    """A value as a table cell shows it; event times as UTC.

    >>> _shown("window_end", 1767225693.5), _shown("tolerance", 0.15), _shown("position_rates", [0.8, 0.62])
    ('2026-01-01T00:01:33.500Z', '0.15', '[0.8, 0.62]')
    """
    name = key.rsplit(".", 1)[-1]
    is_time = name == "ts" or name.endswith(_TIME_SUFFIXES)
    if is_time and isinstance(value, (int, float)) and value > 1e8:
        return _utc(value)
    if isinstance(value, list):
        return "[" + ", ".join(_number(v) for v in value) + "]"
    return _number(value)


def _flatten(prefix: str, value) -> Iterable[tuple[str, object]]:
    if isinstance(value, dict):
        for key in sorted(value):
            yield from _flatten(f"{prefix}.{key}" if prefix else str(key), value[key])
    else:
        yield prefix, value


def _plain(_key: str, value) -> str:
    return _number(value)


def format_pairs(data, limit: int | None = None, show=_shown) -> str:
    """``key=value`` pairs of a dict, nested keys joined by dots; at most ``limit`` of them.

    >>> format_pairs({"al": 1.23456, "window": {"end": 1767225693.5}, "slices": [1, 2]}, limit=2)
    'al=1.235 slices=[1, 2] ...'
    """
    if not isinstance(data, dict):
        return "" if data is None else str(data)
    items = list(_flatten("", data))
    more = ["..."] if limit is not None and len(items) > limit else []
    return " ".join([f"{k}={show(k, v)}" for k, v in items[:limit]] + more)


def _window_rows(record: dict) -> list[dict]:
    rows = []
    for row in _audit(record).get("window") or []:
        row = dict(row)
        checks, mismatches = row.get("shadow_checks") or 0, row.get("shadow_mismatches") or 0
        row["mismatch_rate"] = mismatches / checks if checks else math.nan
        rows.append(row)
    return rows


def _headline(record: dict) -> tuple[str, str]:
    """What was decided where and when, and the measurement that tipped it (may be empty)."""
    finding = _finding(record)
    what = {"disable_speculation": "speculation disabled", "reduce_draft_length": "draft length lowered",
            "invalidate_bundle": "bundle invalidated", "restore": "speculation restored",
            "alert": "alert raised", "promote": "cohort share widened"}.get(record["action"], record["action"])
    text = f"{what} on {_scope(record)} for {record['reason']} at {_utc(record['ts'])}"
    metric, measure = finding.get("metric"), ""
    if metric and finding.get("value") is not None:
        measure = (f"{metric} {_number(finding['value'])} against threshold {_number(finding.get('threshold'))}"
                   f" (baseline {_number(finding.get('baseline'))})")
    return text, measure


def render_text(record: dict, samples: Sequence[dict]) -> str:
    """A short plain-text postmortem: decision, finding, thresholds, baseline, window, card, samples.

    >>> record = {"decision_id": "d-1", "ts": 1767225845.0, "bundle_id": "b-1", "bucket": "coding",
    ...           "cohort": "main", "action": "disable_speculation", "reason": "acceptance_drop",
    ...           "detector": "acceptance_gate", "evidence": {}, "sample_ids": [],
    ...           "audit": {"thresholds": {"tolerance": 0.15}, "baseline": {"acceptance_length": 3.2},
    ...                     "window": [{"slice_end": 1767225844.0, "acceptance_length": 2.1, "requests": 40}],
    ...                     "card": None, "detail": {"finding": {"metric": "acceptance_length", "value": 2.1,
    ...                                                          "threshold": 2.72, "baseline": 3.2}}}}
    >>> print(render_text(record, []))  # doctest: +NORMALIZE_WHITESPACE
    decision d-1: speculation disabled on b-1/coding/main for acceptance_drop at 2026-01-01T00:04:05.000Z:
      acceptance_length 2.1 against threshold 2.72 (baseline 3.2)
    detector: acceptance_gate
    finding: baseline=3.2 metric=acceptance_length threshold=2.72 value=2.1
    thresholds: tolerance=0.15
    baseline: acceptance_length=3.2
    evidence window: 1 slices, -1.0 s .. -1.0 s before the decision
      acceptance_length  first 2.1  last 2.1  min 2.1  max 2.1
    bundle card: (not archived)
    samples: 0
    """
    finding = _finding(record)
    audit = _audit(record)
    what, measure = _headline(record)
    judgement = judgement_lines(finding)  # an admission decision: the judge's per-bucket breakdown
    lines = [f"decision {record['decision_id']}: {what}" + (f":\n  {measure}" if measure else ""),
             f"detector: {record['detector']}",
             "finding: " + format_pairs(_without_judgement(finding) if judgement else finding),
             *judgement,
             "thresholds: " + format_pairs(audit.get("thresholds"), show=_plain),
             "baseline: " + (format_pairs(audit.get("baseline")) or "(none)"),
             *_covered_lines(record)]
    rows = _window_rows(record)
    if rows:
        start = rows[0]["slice_end"] - record["ts"]
        end = rows[-1]["slice_end"] - record["ts"]
        lines.append(f"evidence window: {len(rows)} slices, {start:.1f} s .. {end:.1f} s before the decision")
        for _, _, _, series in PLOTS:
            for _, field in series:
                values = [r.get(field) for r in rows]
                values = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
                if values:
                    lines.append(f"  {field:<18} first {_number(values[0])}  last {_number(values[-1])}  "
                                 f"min {_number(min(values))}  max {_number(max(values))}")
    else:
        lines.append("evidence window: none (an event-triggered decision)")
    card = audit.get("card")
    lines.append("bundle card: " + (format_pairs(card, show=_plain) if card else "(not archived)"))
    lines.append(f"samples: {len(samples)}")
    lines.extend(f"  {sample['kind']:<8}{sample['sample_id']:<28}{sample_summary(sample['record'])}"
                 for sample in samples[:10])
    return "\n".join(lines)


def _covered_lines(record: dict) -> list[str]:
    """The keys a fallback switched off while their own rate tests held evidence short of a
    last look's threshold (the decider's ``covered`` audit): another cause it may hide.

    >>> record = {"audit": {"detail": {"covered": [{"scope": "b-1/reasoning/main", "gate": "latency_slo",
    ...     "evidence_nats": 8.69, "evidence_threshold_nats": 17.65, "look_threshold_nats": 11.184,
    ...     "hits": 5.0, "trials": 48}]}}}
    >>> for line in _covered_lines(record): print(line)
    switched off while their own tests held evidence (short of a last look):
      b-1/reasoning/main  latency_slo  8.69 nats (last look 11.18, usual 17.65): 5 of 48 requests
    """
    covered = _covered(record)
    if not covered:
        return []
    return [_COVERED_TITLE + ":"] + [
        f"  {c['scope']}  {c['gate']}  {_covered_evidence(c)}: {_covered_counted(c)}" for c in covered]


_COVERED_TITLE = "switched off while their own tests held evidence (short of a last look)"


def _covered(record: dict) -> list[dict]:
    return (_audit(record).get("detail") or {}).get("covered") or []


def _covered_evidence(c: dict) -> str:
    return (f"{c['evidence_nats']:.2f} nats (last look {c['look_threshold_nats']:.2f}, "
            f"usual {c['evidence_threshold_nats']:.2f})")


def _covered_counted(c: dict) -> str:
    return f"{c['hits']:g} of {c['trials']} requests"


def _covered_table(record: dict) -> list[str]:
    """The page's section for the decider's ``covered`` audit, as `_covered_lines` prints it.

    >>> record = {"audit": {"detail": {"covered": [{"scope": "b-1/extraction/main", "gate": "error_rate",
    ...     "evidence_nats": 5.6, "evidence_threshold_nats": 15.1, "look_threshold_nats": 8.189,
    ...     "hits": 2.0, "trials": 21}]}}}
    >>> page = "".join(_covered_table(record))
    >>> page.startswith("<h2>Covered keys</h2>"), '<table id="covered">' in page
    (True, True)
    >>> '<td>5.60 nats (last look 8.19, usual 15.10)</td><td>2 of 21 requests</td>' in page
    True
    >>> _covered_table({"audit": None})
    []
    """
    covered = _covered(record)
    if not covered:
        return []
    esc = html.escape
    rows = "".join(
        f'<tr data-scope="{esc(c["scope"])}" data-gate="{esc(c["gate"])}"><td>{esc(c["scope"])}</td>'
        f"<td>{esc(c['gate'])}</td><td>{esc(_covered_evidence(c))}</td><td>{esc(_covered_counted(c))}</td></tr>"
        for c in covered)
    return ["<h2>Covered keys</h2>",
            f'<p class="muted">Keys this fallback {esc(_COVERED_TITLE)}: another cause it may hide.</p>',
            '<table id="covered"><tr><th>scope</th><th>gate</th><th>evidence</th><th>counted</th></tr>'
            + rows + "</table>"]


def _without_judgement(finding: dict) -> dict:
    return {k: v for k, v in finding.items() if k not in ("breakdown", "judgement", "failing")}


def judgement_lines(finding: dict) -> list[str]:
    """The canary judge's breakdown behind an admission decision, one line per bucket and metric.

    >>> finding = {"stage": "frozen", "previous_stage": "canary", "breakdown": {"structured": {
    ...     "outcome": "fail", "canary_requests": 120, "baseline_requests": 900, "metrics": [
    ...         {"metric": "tpot_p99", "outcome": "fail", "canary": 19.6, "baseline": 13.6, "limit": 15.0,
    ...          "p_value": 2.6e-08, "windows": [8, 76]}]}}}
    >>> for line in judgement_lines(finding):
    ...     print(line)
    stage: canary -> frozen
    judgement (canary against baseline, per bucket):
      structured      fail      canary 120 requests, baseline 900
        tpot_p99            fail      canary 19.6  baseline 13.6  limit 15  p 2.6e-08  windows 8/76
    >>> judgement_lines({"metric": "acceptance_length"})
    []
    """
    breakdown = finding.get("breakdown")
    if not isinstance(breakdown, dict):
        return []
    lines = [f"stage: {finding.get('previous_stage') or '-'} -> {finding.get('stage')}"]
    if finding.get("vetoed_by"):
        lines.append(f"vetoed by decision {finding['vetoed_by']} ({finding.get('veto_reason')})")
    lines.append("judgement (canary against baseline, per bucket):")
    for bucket, verdict in sorted(breakdown.items()):
        lines.append(f"  {bucket:<15} {verdict.get('outcome', '?'):<9} canary {verdict.get('canary_requests')} "
                     f"requests, baseline {verdict.get('baseline_requests')}")
        for metric in verdict.get("metrics", []):
            if metric.get("outcome") == "pass" and verdict.get("outcome") == "pass":
                continue  # a passing bucket is summarized by its line
            windows = metric.get("windows") or [0, 0]
            text = (f"    {metric['metric']:<19} {metric['outcome']:<9} canary {_number(metric.get('canary'))}  "
                    f"baseline {_number(metric.get('baseline'))}  limit {_number(metric.get('limit'))}  "
                    f"p {_number(metric.get('p_value'))}  windows {windows[0]}/{windows[1]}")
            if metric.get("note"):
                text += f"  ({metric['note']})"
            lines.append(text)
    return lines


def sample_summary(record: dict) -> str:
    """One line of what a kept telemetry record shows.

    >>> sample_summary({"kind": "request", "finish_reason": "error", "speculative": True,
    ...                 "ttft_ms": 80.0, "tpot_ms": 9.5, "e2e_ms": 1234.5, "output_tokens": 120,
    ...                 "error": "oom"})
    'error spec ttft=80ms tpot=9.5ms e2e=1234ms out=120 error=oom'
    """
    kind = record.get("kind")
    if kind == "request":
        spec = "spec" if record.get("speculative") else "standard"
        text = (f"{record.get('finish_reason')} {spec} ttft={_number(record.get('ttft_ms'))}ms "
                f"tpot={_number(record.get('tpot_ms'))}ms e2e={_number(record.get('e2e_ms'))}ms "
                f"out={record.get('output_tokens')}")
        return text + (f" error={record['error']}" if record.get("error") else "")
    if kind == "step":
        entries = record.get("requests") or []
        drafted = sum(e.get("drafted", 0) for e in entries)
        accepted = sum(e.get("accepted", 0) for e in entries)
        return (f"{len(entries)} requests drafted={drafted} accepted={accepted} "
                f"draft={_number(record.get('draft_ms'))}ms "
                f"verify={_number(record.get('verify_ms'))}ms kv={_number(record.get('kv_usage'))}")
    if kind == "shadow":
        return f"{record.get('check')} {'match' if record.get('match') else 'MISMATCH'}"
    return kind or "?"


def render_html(record: dict, samples: Sequence[dict], reproductions: Sequence[dict] = ()) -> str:
    """A self-contained postmortem page (inline SVG plots, no external resources).

    ``reproductions`` are the archived `specwatch reproduce` results of the decision
    (`Archive.reproductions`); the page links to each from its summary.

    >>> page = render_html({"decision_id": "d-1", "ts": 100.0, "bundle_id": "b-1", "bucket": None,
    ...                     "cohort": None, "action": "alert", "reason": "draft_overhead",
    ...                     "detector": "draft_cost_gate", "evidence": {}, "sample_ids": [], "audit": None}, [])
    >>> page.startswith("<!DOCTYPE html>"), 'data-decision-id="d-1"' in page
    (True, True)
    """
    esc = html.escape
    audit = _audit(record)
    finding = _finding(record)
    title = f"specwatch postmortem {record['decision_id']}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>",
        f'<main id="postmortem" data-decision-id="{esc(record["decision_id"])}" '
        f'data-reason="{esc(record["reason"])}" data-action="{esc(record["action"])}">',
        f'<h1>Decision <span id="decision-id">{esc(record["decision_id"])}</span></h1>',
        f'<p id="summary">{esc(": ".join(p for p in _headline(record) if p))}</p>',
        *([f'<p id="reproduced">Reproduced: {" ".join(_reproduction_link(r) for r in reproductions)}</p>']
          if reproductions else []),
        '<table id="decision">',
        _row("action", record["action"], "action"),
        _row("reason", record["reason"], "reason"),
        _row("detector", record["detector"], "detector"),
        _row("scope", _scope(record), "scope"),
        _row("event time", f"{_utc(record['ts'])} ({record['ts']:.3f})", "ts"),
        "</table>",
        "<h2>Finding and thresholds</h2>",
        _key_value_table("finding", _without_judgement(finding)),
        *([f'<pre id="judgement">{esc(chr(10).join(judgement_lines(finding)))}</pre>']
          if judgement_lines(finding) else []),
        f'<p class="muted">Policy settings of the gate that fired ({esc(record["detector"])}):</p>',
        _key_value_table("thresholds", audit.get("thresholds") or {}),
        "<h2>Baseline it was compared to</h2>",
        _key_value_table("baseline", audit.get("baseline") or {}),
        *_covered_table(record),
        "<h2>Evidence window</h2>",
    ]
    rows = _window_rows(record)
    if rows:
        parts.append(f'<p class="muted">{len(rows)} slices before the decision; time in seconds relative to '
                     "the decision (0 = decision). Dashed lines: the threshold (red) and the baseline (grey) "
                     "of the metric that fired.</p>")
        plots = "\n".join(_plot(plot, rows, record, finding) for plot in PLOTS)
        parts.append(f'<div class="plots" id="plots">{plots}</div>')
    else:
        parts.append('<p id="plots-none" class="muted">No per-slice window: this decision was triggered by a '
                     "discrete event (a card change or a shadow mismatch); the samples below are the event.</p>")
    parts.append("<h2>Bundle card</h2>")
    card = audit.get("card")
    parts.append(_key_value_table("card", card) if card else '<p id="card" class="muted">Not archived.</p>')
    parts += [f"<h2>Samples ({len(samples)})</h2>", _samples_table(samples)]
    if reproductions:
        parts += [f"<h2>Reproductions ({len(reproductions)})</h2>",
                  _reproductions_table(reproductions)]
    parts.append("</main></body></html>")
    return "\n".join(parts)


def _row(name: str, value, ident: str | None = None) -> str:
    attr = f' id="field-{html.escape(ident)}"' if ident else ""
    return f"<tr><th>{html.escape(name)}</th><td{attr}>{html.escape(_number(value))}</td></tr>"


def _key_value_table(ident: str, data: dict) -> str:
    items = list(_flatten("", data))
    if not items:
        return f'<p id="{ident}" class="muted">None.</p>'
    body = "".join(f'<tr data-key="{html.escape(k)}"><th>{html.escape(k)}</th><td>{html.escape(_shown(k, v))}</td></tr>'
                   for k, v in items)
    return f'<table id="{ident}">{body}</table>'


def _samples_table(samples: Sequence[dict]) -> str:
    if not samples:
        return '<p id="samples" class="muted">No samples archived with this decision.</p>'
    rows = []
    for sample in samples[:_MAX_SAMPLE_ROWS]:
        record = sample["record"]
        rows.append(
            f'<tr data-sample-id="{html.escape(str(sample["sample_id"]))}"><td>{html.escape(sample["kind"])}</td>'
            f"<td><code>{html.escape(str(sample['sample_id']))}</code></td><td>{html.escape(_utc(sample['ts']))}</td>"
            f"<td>{html.escape(sample_summary(record))}</td><td><details><summary>record</summary>"
            f"<pre>{html.escape(json.dumps(record, sort_keys=True, indent=1))}</pre></details></td></tr>")
    hidden = len(samples) - _MAX_SAMPLE_ROWS
    more = f'<p class="muted">{hidden} more not shown.</p>' if hidden > 0 else ""
    return ('<table id="samples"><tr><th>kind</th><th>id</th><th>event time</th><th>what</th><th>raw</th></tr>'
            + "".join(rows) + "</table>" + more)


def _reproduction_link(reproduction: dict) -> str:
    ident = html.escape(reproduction["reproduction_id"])
    return f'<a href="#{ident}">{ident} ({html.escape(reproduction["verdict"])})</a>'


def _reproductions_table(reproductions: Sequence[dict]) -> str:
    rows = []
    for reproduction in reproductions:
        result = reproduction["result"]
        requests = "; ".join(
            f"{r['sample_id']}: {r['verdict']}, first divergence {_number(r['first_divergence'])}, acceptance by "
            f"position {' '.join(_number(x) for x in r['position_acceptance'])}"
            for r in result.get("requests", ()))
        rows.append(
            f'<tr id="{html.escape(reproduction["reproduction_id"])}" data-verdict="{html.escape(reproduction["verdict"])}">'
            f"<td><code>{html.escape(reproduction['reproduction_id'])}</code></td>"
            f"<td>{html.escape(_utc(reproduction['ts']))}</td><td>{html.escape(reproduction['actor'])}</td>"
            f"<td>{html.escape(reproduction['verdict'])}</td><td>{html.escape(requests)}</td></tr>")
    return ('<table id="reproductions"><tr><th>id</th><th>when</th><th>who</th><th>verdict</th><th>requests</th></tr>'
            + "".join(rows) + "</table>")


def _plot(plot, rows: list[dict], record: dict, finding: dict) -> str:
    """One evidence plot: the window's series, and the threshold and baseline of the metric that fired."""
    from matplotlib.figure import Figure

    from specwatch.analysis.timeline import inline_svg

    ident, title, unit, series = plot
    xs = [row["slice_end"] - record["ts"] for row in rows]
    references = [("break-even", 1.0, "#777")] if ident == "speedup" else []
    if _METRIC_PLOT.get(finding.get("metric")) == ident:
        references += [(key, _float(finding.get(key)), color)
                       for key, color in (("threshold", "#d62728"), ("baseline", "#777"))]
    axes = Figure(figsize=(5.2, 2.2), layout="tight").subplots()
    measured = False
    for label, field in series:  # a NaN (nothing measured in a slice) breaks the line
        ys = [_float(row.get(field)) for row in rows]
        measured = measured or not all(map(math.isnan, ys))
        axes.plot(xs, ys, marker=".", linewidth=1.5, label=label, gid=f"series-{label}")
    for label, value, color in references:
        if not math.isnan(value):
            axes.axhline(value, color=color, linestyle="--", linewidth=1, gid=f"reference-{label}",
                         label=f"{label} {_number(value)}")
    if not measured:
        axes.text(0.5, 0.5, "no data in this window", transform=axes.transAxes, ha="center")
    axes.set_xlabel("seconds relative to the decision", fontsize=8)
    axes.set_ylabel(unit, fontsize=8)
    axes.tick_params(labelsize=8)
    axes.legend(fontsize=7)
    svg = inline_svg(axes.figure, f"plot-{ident}")
    return f'<figure data-plot="{ident}">{svg}<figcaption>{html.escape(title)}</figcaption></figure>'


def _float(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
