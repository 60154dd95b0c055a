"""`specwatch replay`: contract-v1 JSON Lines in, decisions as JSON Lines out, by event time.

Any producer's telemetry can be replayed; the same input always gives the same decisions.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


__all__ = ["register", "replay_file"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay", help="replay contract-v1 JSON Lines and write the decisions",
        description="Replay contract-v1 telemetry (JSON Lines) through the detectors and write "
                    "the decisions as JSON Lines in event-time order.")
    parser.add_argument("input", help="telemetry file (JSON Lines), or - for stdin")
    parser.add_argument("--output", "-o", required=True, help="where to write decisions (JSON Lines), - for stdout")
    parser.add_argument("--policy", help="policy TOML file (defaults built in)")
    parser.add_argument("--archive", help="also archive decisions, evidence and samples to this DSN "
                                          "(e.g. chdb://specwatch-data/archive)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.set_defaults(func=_run)


def replay_file(source, output, pipeline) -> dict:
    """Feed every line of ``source`` and write decisions to ``output``; returns the counters."""
    for line in source:
        for decision in pipeline.feed_line(line):
            output.write(decision.to_json_line() + "\n")
    for decision in pipeline.finish():
        output.write(decision.to_json_line() + "\n")
    return pipeline.counters.as_dict()


def _run(args) -> int:
    # imported here: the detectors pull in river (and scipy), which every other
    # subcommand's start-up should not pay for
    from specwatch.schemas import PolicyError, load_policy
    from specwatch.streams.fastpath import FastPipeline

    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(f"specwatch replay: {error}", file=sys.stderr)
        return 2
    sinks = []
    archive = None
    if args.archive:
        from specwatch.actions.handlers import ArchiveSink
        from specwatch.actions.archive import Archive

        archive = Archive.open(args.archive)
        sinks.append(ArchiveSink(archive))
    # same decisions as EmbeddedPipeline (tests/test_fastpath.py), without pydantic per step
    pipeline = FastPipeline(policy, sinks=sinks)
    with contextlib.ExitStack() as stack:
        try:
            source = sys.stdin.buffer if args.input == "-" else stack.enter_context(open(args.input, "rb"))
            out = sys.stdout if args.output == "-" else stack.enter_context(
                open(args.output, "w", encoding="utf-8"))
        except OSError as error:
            print(f"specwatch replay: {error.filename}: {error.strerror}", file=sys.stderr)
            return 2
        summary = replay_file(source, out, pipeline)
    if archive is not None:
        for sink in sinks:
            sink.close()
        archive.close()
    summary["output"] = args.output
    if args.json:
        print(json.dumps(summary, sort_keys=True), file=sys.stderr if args.output == "-" else sys.stdout)
    else:
        stream = sys.stderr if args.output == "-" else sys.stdout
        print(f"records read: {summary['lines']} lines, {summary['records']} valid, "
              f"{summary['rejected']} rejected", file=stream)
        for reason, count in summary["rejected_by_reason"].items():
            print(f"  rejected {reason}: {count}", file=stream)
        if summary["late_records"]:
            print(f"late records folded forward: {summary['late_records']}", file=stream)
        for flagged in summary["flagged"]:
            print(f"  line {flagged['line']}: {flagged['reason']}: {flagged['detail']}", file=stream)
        shown = len(summary["flagged"])
        if shown < summary["rejected"] + summary["late_records"]:
            print(f"  ({summary['rejected'] + summary['late_records'] - shown} more not listed)", file=stream)
        print(f"decisions: {summary['decisions']} -> {args.output}", file=stream)
    return 0
