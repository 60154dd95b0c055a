"""`specwatch bench`: throughput, latency and cost, each figure beside an alternative measured in the same run."""

from __future__ import annotations

import json
import sys

from specwatch.lab.bench import SECTIONS

from ._arguments import check_output

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = ("Stream processor, Kafka end to end, collector, archive, replay and cost growth; "
               "every figure comes with a ratio against an alternative measured in the same run.")


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quick", action="store_true", help="smaller inputs and a 20 s Kafka run")
    parser.add_argument("--smoke", action="store_true", help="tiny inputs: checks the report's shape only")
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="Kafka broker for the end-to-end section and the export section's direct path "
                             "(default: a broker of this run's own, started with deploy/kafka/broker.sh)")
    parser.add_argument("--section", action="append", default=[], choices=SECTIONS,
                        help="run only these sections (repeatable)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw the stream and growth figures, and the keys figure beside them (FILE-keys.png)")


def run(args) -> int:
    from specwatch.lab.bench.figures import keys_picture, plot_report, run_bench

    if args.plot:  # refused before the run, not after it: neither picture may name a file the run reads
        check_output(args.plot, args)
        check_output(keys_picture(args.plot), args)
    report = run_bench(quick=args.quick, smoke=args.smoke, bootstrap=args.bootstrap,
                       sections=tuple(args.section), log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.plot:
        plot_report(report, args.plot)
    failed = 1 if report["failed_sections"] else 0  # the report is printed whole either way
    if args.json:
        print(json.dumps(report, sort_keys=True, default=float))
        return failed
    for row in report.get("stream", []) if isinstance(report.get("stream"), list) else []:
        print(f"stream {row['encoding']:5} {row['requests_per_step']:5.1f} req/step: "
              f"{row['columnar_rounds_per_s']:>11,.0f} rounds/s/core  x{row['speedup_vs_naive']:.1f} vs per-round, "
              f"x{row['speedup_vs_reference']:.2f} vs reference")
    metrics = report.get("metrics")
    if isinstance(metrics, dict) and "overhead_ratio" in metrics:
        print(f"metrics view: stage 2 over {metrics['keys']} keys {metrics['stage2_on_s']:.3f} s with it, "
              f"{metrics['stage2_off_s']:.3f} s without ({metrics['overhead_ratio'] * 100:+.2f} %), the view's part alone "
              f"{metrics['observe_share_of_stage2'] * 100:.4f} %; a scrape "
              f"{metrics['scrape_ms']:.1f} ms, every 15 s {metrics['scrape_core_share_at_15s'] * 100:.2f} % of a core")
    for name in ("collector", "export", "engine", "archive", "replay", "kafka"):
        print(f"{name}: {json.dumps(report.get(name), default=float)}")
    for row in report.get("growth", []) if isinstance(report.get("growth"), list) else []:
        print(f"growth {row['keys']:>6} keys: {row['columnar_rounds_per_s']:>11,.0f} rounds/s, "
              f"{row['state_bytes_per_key']:>9,.0f} B/key")
    keys = report.get("keys")
    for row in keys.get("curve", []) if isinstance(keys, dict) else []:
        print(f"keys {row['keys']:>6}, 1 round per key-slice: {row['rounds_per_s']:>9,.0f} rounds/s, "
              f"{row['us_per_key_slice']:6.1f} us per key-slice ({row['stage2_us_per_key_slice']:.1f} in stage 2), "
              f"x{row['over_one_key_rate']:.3f} of the 1-key rate ({keys['one_key_rounds_per_s']:,.0f})")
    for row in report.get("targets", []):
        if row["met"] is None:
            print(f"target {row['target']}: {row['note']}")
            continue
        versus = (f", {row['alternative']} {row['alternative_value']:,.2f} (x{row['ratio']:.3f})"
                  if row["ratio"] is not None else "")
        goal = f"{row['goal_is']} {row['goal']:,} on the {row['goal_on']}" if row["goal"] is not None else "stated"
        print(f"target {row['target']}: {row['measured']:,.2f}{versus}; goal {goal}: "
              f"{'met' if row['met'] else 'NOT met'}")
    for name in report["failed_sections"]:
        print(f"section {name} FAILED: {report[name]['error']}")
    return failed
