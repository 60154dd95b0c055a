"""Builds deploy/grafana/specwatch.json, the Grafana dashboard of specwatch, with grafana-foundation-sdk.

    python deploy/grafana/generate.py            # rewrite specwatch.json beside this file
    python deploy/grafana/generate.py --check    # exit 1 when specwatch.json differs from what this builds

Every panel reads the metrics `specwatch run` workers serve (docs/OPERATIONS.md) from a
Prometheus data source chosen on the dashboard; ``$bundle`` and ``$bucket`` narrow the
per-bucket panels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import statetimeline, timeseries
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUTPUT = Path(__file__).with_name("specwatch.json")
_DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
_KEY = 'bundle=~"$bundle", bucket=~"$bucket"'
_SCOPE_LEGEND = "{{bucket}}/{{cohort}}"

# (title, unit, [(PromQL, legend)]) per row; a panel kind of "state" draws a state timeline.
_SPECULATION = [
    ("Acceptance length (tokens per round)", "none", [(f"specwatch_acceptance_length{{{_KEY}}}", _SCOPE_LEGEND)]),
    ("Acceptance rate", "percentunit", [(f"specwatch_acceptance_rate_ratio{{{_KEY}}}", _SCOPE_LEGEND)]),
    ("Draft overhead (share of step time)", "percentunit",
     [(f"specwatch_draft_overhead_ratio{{{_KEY}}}", _SCOPE_LEGEND)]),
    ("Estimated speedup", "none", [(f"specwatch_estimated_speedup_ratio{{{_KEY}}}", _SCOPE_LEGEND)]),
    ("e2e p50 / p99", "s", [(f'specwatch_e2e_seconds{{{_KEY}, quantile="0.5"}}', "p50 " + _SCOPE_LEGEND),
                            (f'specwatch_e2e_seconds{{{_KEY}, quantile="0.99"}}', "p99 " + _SCOPE_LEGEND)]),
    ("TPOT p99", "s", [(f'specwatch_tpot_seconds{{{_KEY}, quantile="0.99"}}', _SCOPE_LEGEND)]),
    ("TTFT p95", "s", [(f'specwatch_ttft_seconds{{{_KEY}, quantile="0.95"}}', _SCOPE_LEGEND)]),
    ("Error rate", "percentunit", [(f"specwatch_error_ratio{{{_KEY}}}", _SCOPE_LEGEND)]),
    ("KV-cache peak (whole bundle)", "percentunit",
     [('specwatch_kv_usage_peak_ratio{bundle=~"$bundle", bucket="*"}', "{{bundle}}")]),
]
_FLAGS = [
    ("Speculation on (1) / off (0)", "none", [(f"specwatch_speculation_enabled{{{_KEY}}}", _SCOPE_LEGEND)], "state"),
    ("Draft length in force", "none", [(f"specwatch_draft_length_tokens{{{_KEY}}}", _SCOPE_LEGEND)], "state"),
    ("Off, with reason", "none", [(f"specwatch_speculation_off{{{_KEY}}}", _SCOPE_LEGEND + " {{reason}}")],
     "state"),
    ("Decisions by action and reason", "none",
     [("sum by (action, reason) (increase(specwatch_decisions_total[$__rate_interval]))", "{{action}} {{reason}}")],
     "series"),
]
_HEALTH = [
    ("Records read / s", "ops", [("sum(rate(specwatch_records_read_total[$__rate_interval]))", "read")]),
    ("Records rejected / s by reason", "ops",
     [("sum by (reason) (rate(specwatch_records_rejected_total[$__rate_interval]))", "{{reason}}")]),
    ("Consumer lag (messages)", "none",
     [("sum by (topic) (specwatch_consumer_lag_messages)", "{{topic}}")]),
    ("Event-time watermark delay", "s",
     [("max by (topic, partition) (specwatch_watermark_delay_seconds)", "{{topic}}/{{partition}}")]),
    ("Slice close delay and decision latency (p99)", "s",
     [("histogram_quantile(0.99, sum by (le) (rate(specwatch_slice_close_delay_seconds_bucket[$__rate_interval])))",
       "slice close p99"),
      ("histogram_quantile(0.99, sum by (le) (rate(specwatch_decision_latency_seconds_bucket[$__rate_interval])))",
       "decision latency p99")]),
    ("Checkpoint age", "s", [("max by (stage, partition) (specwatch_checkpoint_age_seconds)",
                              "{{stage}}/{{partition}}")]),
    ("Archive spool", "bytes", [("sum by (instance) (specwatch_archive_spool_bytes)", "{{instance}}")]),
    ("Decisions waiting for the decisions topic", "none",
     [("sum by (instance) (specwatch_decisions_outbox)", "{{instance}}")]),
    ("Engine worker heartbeat age", "s", [("specwatch_engine_heartbeat_age_seconds", "{{worker}}")]),
    ("Alertmanager: alerts posted by result", "none",
     [("sum by (result) (increase(specwatch_alertmanager_alerts_total[$__rate_interval]))", "{{result}}")]),
    ("Alertmanager webhook: alerts by outcome", "none",
     [("sum by (outcome) (increase(specwatch_webhook_alerts_total[$__rate_interval]))", "{{outcome}}")]),
    ("Workers up", "none", [('up{job="specwatch"}', "{{instance}}")]),
]
_DECISION_ANNOTATION = "changes(specwatch_decisions_total[1m]) > 0"


def _panel(title: str, unit: str, queries, kind: str = "series"):
    """A time series (a third of a row), or a state timeline (half a row), of ``queries``."""
    panel, span = (statetimeline.Panel(), 12) if kind == "state" else (timeseries.Panel(), 8)
    panel = panel.title(title).unit(unit).datasource(_DATASOURCE).height(8).span(span)
    for ref, (expr, legend) in zip("ABCDEFGH", queries):
        panel = panel.with_target(Dataquery().expr(expr).legend_format(legend).ref_id(ref))
    return panel


def build() -> Dashboard:
    """The dashboard, as a grafana-foundation-sdk builder."""
    dashboard = (
        Dashboard("specwatch")
        .uid("specwatch")
        .tags(["specwatch", "speculative-decoding"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(QueryVariable("bundle").label("bundle").datasource(_DATASOURCE)
                       .query("label_values(specwatch_acceptance_length, bundle)")
                       .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
                       .all_value(".*"))
        .with_variable(QueryVariable("bucket").label("bucket").datasource(_DATASOURCE)
                       .query('label_values(specwatch_acceptance_length{bundle=~"$bundle"}, bucket)')
                       .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
                       .all_value(".*"))
        .annotation(AnnotationQuery().name("specwatch decisions").datasource(_DATASOURCE).enable(True)
                    .icon_color("red").expr(_DECISION_ANNOTATION))
    )
    for row, panels in (("Speculation per bucket", _SPECULATION), ("Flags and decisions", _FLAGS),
                        ("Service health", _HEALTH)):
        dashboard = dashboard.with_row(Row(row))
        for panel in panels:
            dashboard = dashboard.with_panel(_panel(*panel))
    return dashboard


def render() -> str:
    """The dashboard JSON exactly as committed (sorted keys, two-space indent, final newline)."""
    body = json.loads(JSONEncoder(sort_keys=True).encode(build().build()))
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(OUTPUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
