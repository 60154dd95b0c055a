"""`specwatch simulate`: write a seeded fleet's contract-v1 telemetry as JSON Lines.

The simulator is built from the arguments in one place and records go to one sink
function, so other destinations (a Kafka topic) can be added beside the file.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import nullcontext
from typing import Iterable, TextIO

__all__ = ["register", "build_simulator", "write_json_lines", "summary_line"]

_EXIT_USAGE = 2
_EXIT_IO = 1


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="write simulated fleet telemetry (contract v1 JSON Lines)",
        description="Simulate a fleet of speculative-decoding engine workers, deterministically from a seed, "
                    "with an optional scripted incident, and write contract-v1 JSON Lines.")
    parser.add_argument("--output", "-o", metavar="FILE", help="JSON Lines file to write ('-' for stdout)")
    parser.add_argument("--scenario", default="demo", help="scenario name (see --list; default: demo)")
    parser.add_argument("--minutes", type=float, default=None, help="simulated minutes (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=7, help="random seed (default: 7)")
    parser.add_argument("--workers", type=int, default=8, help="engine workers in the fleet (default: 8)")
    parser.add_argument("--intensity", type=float, default=None,
                        help="strength of the scenario's incident, in the unit of its kind (see --list)")
    parser.add_argument("--incident-at", type=float, default=None, metavar="SECONDS",
                        help="seconds after the start at which incidents begin (default: the scenario's)")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.set_defaults(func=run)


def build_simulator(args: argparse.Namespace, flags=None):
    """The `Simulator` the arguments describe; raises ValueError with a message for people."""
    from specwatch.collectors.simulator import Simulator

    return Simulator(args.scenario, seed=args.seed, minutes=args.minutes, workers=args.workers,
                     intensity=args.intensity, incident_at=args.incident_at, flags=flags)


def write_json_lines(records: Iterable, stream: TextIO) -> Counter:
    """Write each record as one contract-v1 JSON line; returns how many of each kind."""
    from specwatch.schemas import encode_record

    counts: Counter = Counter()
    write = stream.write
    for record in records:
        write(encode_record(record))
        write("\n")
        counts[record.kind] += 1
    return counts


def summary_line(simulator, counts: Counter, destination: str) -> str:
    """One line for stderr: what was written where, and the incidents with their start times."""
    kinds = ", ".join(f"{counts.get(kind, 0)} {kind}" for kind in ("bundle", "step", "request", "shadow"))
    incidents = ", ".join(
        f"{i.kind}@{i.start_ts - simulator.start_ts:g}s"
        + (f"[{'/'.join(x for x in (i.bucket, i.cohort) if x)}]" if i.bucket or i.cohort else "")
        for i in simulator.incidents) or "none"
    return (f"simulate: scenario {simulator.scenario}, seed {simulator.seed}, {simulator.workers} workers, "
            f"{simulator.minutes:g} min -> {destination}: {sum(counts.values())} records ({kinds}); "
            f"incidents: {incidents}")


def _list_scenarios(stream: TextIO) -> None:
    from specwatch.collectors.simulator import SCENARIOS

    width = max(len(name) for name in SCENARIOS)
    for name, description in SCENARIOS.items():
        stream.write(f"{name:<{width}}  {description}\n")


def run(args: argparse.Namespace) -> int:
    if args.list:
        _list_scenarios(sys.stdout)
        return 0
    if not args.output:
        print("specwatch simulate: error: --output FILE is required (or --list)", file=sys.stderr)
        return _EXIT_USAGE
    try:
        simulator = build_simulator(args)
    except ValueError as error:
        print(f"specwatch simulate: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    to_stdout = args.output == "-"
    try:
        with (nullcontext(sys.stdout) if to_stdout else open(args.output, "w", encoding="utf-8")) as stream:
            counts = write_json_lines(simulator.records(), stream)
    except OSError as error:
        print(f"specwatch simulate: error: cannot write {args.output}: {error.strerror or error}", file=sys.stderr)
        return _EXIT_IO
    print(summary_line(simulator, counts, "stdout" if to_stdout else args.output), file=sys.stderr)
    return 0
