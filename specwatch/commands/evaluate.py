"""`specwatch evaluate`: detection quality against operator baselines (docs/EVALUATION.md)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

from specwatch.commands._arguments import CommandError, add_json_option, add_policy_option, check_output, load_policy

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = ("Run seeded simulator scenarios for every row of the fallback table at several "
               "intensities, plus long incident-free runs, through specwatch and the two baselines "
               "operators use today (an engine kill switch on rolling acceptance, a Prometheus alert "
               "on vLLM counters) on the same telemetry; print delays, verdicts and false alarms.")


def add_arguments(parser) -> None:
    add_json_option(parser, help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true",
                        help="one intensity per row (the one its target is stated for) and shorter healthy runs")
    parser.add_argument("--seed", type=int, default=11, help="simulator seed of every case (default 11)")
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1),
                        help="cases run in parallel on this many processes (default: up to 2)")
    add_policy_option(parser)
    parser.add_argument("--overlap", action="store_true",
                        help="run only the overlap suite: seeded runs of two to four incidents at once, closed and "
                             "open loop, at 8 x 16 and 2 x 8 (with --quick: its two-run subset)")
    parser.add_argument("--overlap-runs", type=int, default=40, help="seeded overlap runs (default 40)")
    parser.add_argument("--plot", default="specwatch-data/evaluation.png",
                        help="PNG of delay against each incident key's traffic, with the information bound "
                             "(default specwatch-data/evaluation.png)")


def run(args) -> int:
    from specwatch.lab.evaluation import (calibrate, format_report, full_suite, plot_sweep, quick_suite, run_suite,
                                      summarize)
    from specwatch.lab.evaluation.draft_length import CASES, format_draft_length

    policy = load_policy(args.policy)
    check_output(args.plot, args)
    if args.seed < 0 or args.processes < 1 or args.overlap_runs < 1:
        raise CommandError("--seed must be >= 0, --processes and --overlap-runs >= 1")
    if args.overlap:
        return _run_overlap(args, policy)
    cases = quick_suite(args.seed) if args.quick else full_suite(args.seed)
    started = time.monotonic()
    settings = calibrate()
    total = len(cases) + len(CASES)
    print(f"calibrated: healthy acceptance rate {settings.healthy_rate:.3f}, baseline thresholds "
          f"{settings.kill_switch_threshold:.2f}; running {total} cases on {args.processes} "
          "processes", file=sys.stderr, flush=True)
    done = itertools.count(1)

    def progress(result: dict) -> None:
        print(f"  [{next(done):>2}/{total}] {result['case']:<40} "
              f"{result['simulated_seconds'] / 60:6.1f} sim-min "
              f"in {result['wall_seconds']:6.1f} s", file=sys.stderr, flush=True)

    results = run_suite(cases, settings, policy, processes=args.processes, progress=progress,
                        draft_length=CASES, draft_length_seed=args.seed)
    summary = summarize(results[:len(cases)], settings.to_dict(), "quick" if args.quick else "full")
    summary["draft_length"] = results[len(cases):]
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot_sweep(summary, args.plot)
        summary["plot"] = args.plot
    except OSError as error:
        print(f"specwatch evaluate: cannot write the plot {args.plot}: {error.strerror or error}; "
              "pass --plot with a writable path", file=sys.stderr)
        summary["plot"] = None
    summary["overlap"] = _overlap_summary(args, policy)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(summary, sort_keys=True, allow_nan=False, default=str))
    else:
        from specwatch.lab.evaluation.overlap import format_overlap

        print(format_report(summary))
        print(format_draft_length(summary["draft_length"]))
        print("\n" + format_overlap(summary["overlap"]))
        print(f"\n{len(cases)} cases in {summary['wall_seconds']:.0f} s", file=sys.stdout)
    return 0


def _overlap_summary(args, policy) -> dict:
    """The overlap suite (`specwatch.lab.evaluation.overlap`): its runs, each incident alone, summarized."""
    from specwatch.lab.evaluation.overlap import overlap_runs, quick_overlap_runs, run_overlap_suite, summarize_overlap

    runs = quick_overlap_runs() if args.quick else overlap_runs(args.overlap_runs)
    done = itertools.count(1)

    def progress(result: dict) -> None:
        print(f"  [overlap {next(done):>2}] {result['run']:<70} {result['simulated_seconds'] / 60:5.1f} sim-min "
              f"in {result['wall_seconds']:6.1f} s", file=sys.stderr, flush=True)

    print(f"overlap suite: {len(runs)} runs, then each of their incidents alone", file=sys.stderr, flush=True)
    return summarize_overlap(run_overlap_suite(runs, policy, processes=args.processes, progress=progress))


def _run_overlap(args, policy) -> int:
    from specwatch.lab.evaluation.overlap import format_overlap

    started = time.monotonic()
    summary = _overlap_summary(args, policy)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(summary, sort_keys=True, allow_nan=False, default=str))
    else:
        print(format_overlap(summary))
    return 0
