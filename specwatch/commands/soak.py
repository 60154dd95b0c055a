"""`specwatch soak`: steady simulated load, watching that memory and lag stay flat."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

from specwatch.commands._arguments import CommandError, add_json_option

__all__ = ["DESCRIPTION", "add_arguments", "run"]

_DEFAULT_SAMPLE_SECONDS = 5.0
_DEFAULT_RATE = 400.0  # records/s: a few busy engine workers


DESCRIPTION = ("Run a seeded healthy fleet in real time through the embedded pipeline (or through "
               "Kafka with --bootstrap) and sample RSS, event-time lag and queue depths.")


def add_arguments(parser) -> None:
    parser.add_argument("--minutes", type=float, required=True, help="how long to run (wall clock)")
    parser.add_argument("--rate", type=float, default=_DEFAULT_RATE,
                        help="target telemetry records per second (default: %(default)s)")
    parser.add_argument("--bootstrap", metavar="HOST:PORT", help="go through this Kafka cluster first")
    parser.add_argument("--topic", help="telemetry topic for --bootstrap (default: a new topic, deleted after)")
    parser.add_argument("--sample-seconds", type=float, default=_DEFAULT_SAMPLE_SECONDS,
                        help="seconds between samples (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=7)
    add_json_option(parser, help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    from specwatch.lab.bench.steady_load import run_soak, workers_for

    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        raise CommandError("--minutes must be a positive number")
    if not args.rate > 0 or not args.sample_seconds > 0:
        raise CommandError("--rate and --sample-seconds must be positive")
    workers = workers_for(args.rate, args.seed)
    out = None if args.json else sys.stdout
    if out is not None:
        print(f"soak: {args.minutes:g} min, ~{args.rate:g} records/s from {workers} simulated workers, {'through Kafka at ' + args.bootstrap if args.bootstrap else 'embedded'}; "
              f"pid {os.getpid()}", flush=True)
    result = run_soak(args.minutes, args.rate, args.seed, args.sample_seconds, workers, bootstrap=args.bootstrap,
                      topic=args.topic, out=out)
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        _print_summary(result)
    return 0 if result.memory_flat and result.lag_flat else 1


def _print_summary(r) -> None:
    print(f"\n{r.mode}: {r.records} records in {r.minutes:g} min ({r.rate_achieved}/s, target {r.rate_target:g}/s), "
          f"{r.rejected} rejected, {r.decisions} decisions, {r.samples} samples")
    print(f"  memory: {r.rss_start_mb:.1f} -> {r.rss_end_mb:.1f} MB (max {r.rss_max_mb:.1f}), "
          f"slope {r.rss_slope_mb_per_min:+.3f} MB/min after warm-up: {'FLAT' if r.memory_flat else 'GROWING'}")
    print(f"  lag: mean {r.lag_mean_s:.2f} s, max {r.lag_max_s:.2f} s, slope {r.lag_slope_s_per_min:+.4f} s/min: "
          f"{'FLAT' if r.lag_flat else 'GROWING'}")
    if r.mode == "kafka":
        print(f"  queues: emit queue max {r.max_emit_queue}, consumer lag max {r.max_consumer_lag} messages; "
              f"{r.dropped} dropped, {r.failed} failed")
