"""`specwatch simulate`: a seeded fleet's telemetry as JSON Lines, to Kafka or over OTLP."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from typing import Iterable

from specwatch.commands._arguments import CommandError
from specwatch.transport.topics import TELEMETRY_TOPIC

__all__ = ["DESCRIPTION", "add_arguments", "run", "send", "summary_line"]

_EXIT_IO = 1
# Flushed this often in event time, so no worker runs far ahead of another on a partition.
_FLUSH_EVENT_SECONDS = 0.5
_CONNECT_TIMEOUT_S = 5.0  # to find that no bootstrap server is listening
_PACE_EVERY_RECORDS = 64


DESCRIPTION = ("Simulate a fleet of speculative-decoding engine workers, deterministically from a seed, "
               "with an optional scripted incident, and write contract-v1 JSON Lines.")


def add_arguments(parser) -> None:
    parser.add_argument("--output", "-o", metavar="FILE", help="JSON Lines file to write ('-' for stdout)")
    parser.add_argument("--scenario", default="demo", help="scenario name (see --list; default: demo)")
    parser.add_argument("--minutes", type=float, default=None, help="simulated minutes (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=7, help="random seed (default: 7)")
    parser.add_argument("--workers", type=int, default=8, help="engine workers in the fleet (default: 8)")
    parser.add_argument("--intensity", type=float, default=None,
                        help="strength of the scenario's incident, in the unit of its kind (see --list)")
    parser.add_argument("--incident-at", type=float, default=None, metavar="SECONDS",
                        help="seconds after the start at which incidents begin (default: the scenario's)")
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="send to Kafka instead of a file: OTLP log records through the OpenTelemetry "
                             "Kafka exporter, message key = worker")
    parser.add_argument("--otlp", nargs="?", const="", default=None, metavar="ENDPOINT",
                        help="send to an OpenTelemetry Collector instead of a file: OTLP through OpenTelemetry's "
                             "exporter, configured by the standard OTEL_EXPORTER_OTLP_* variables; ENDPOINT, when "
                             "given, is the base endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)")
    parser.add_argument("--topic", default=TELEMETRY_TOPIC, help=f"telemetry topic (default: {TELEMETRY_TOPIC})")
    parser.add_argument("--rate", type=float, default=0.0, metavar="RECORDS_PER_S",
                        help="with --bootstrap or --otlp: at most this many records per second (default 0: as fast "
                             "as the exporter goes)")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")


def send(records: Iterable, exporter, rate: float = 0.0) -> tuple[Counter, dict]:
    """Emit every record through ``exporter`` (which this shuts down), waiting when its queue is
    full; counts by kind and exporter stats."""
    from specwatch.collectors.otel import TelemetryEmitter

    emitter = TelemetryEmitter(exporter, sdk=False)
    counts: Counter = Counter()
    started = time.monotonic()
    next_flush = None
    try:
        for index, record in enumerate(records):
            if next_flush is None:
                next_flush = record.ts + _FLUSH_EVENT_SECONDS
            elif record.ts >= next_flush:
                emitter.force_flush()
                next_flush = record.ts + _FLUSH_EVENT_SECONDS
            while not emitter.emit(record):
                emitter.force_flush()  # queue full: let the exporter catch up, then offer again
            counts[record.kind] += 1
            if rate and index % _PACE_EVERY_RECORDS == 0:
                ahead = started + index / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        emitter.force_flush()
    finally:
        emitter.shutdown()
    stats = dict(exporter.stats(), dropped=emitter.stats().dropped, failed=emitter.stats().failed,
                 seconds=round(time.monotonic() - started, 3))
    return counts, stats


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


def run(args: argparse.Namespace) -> int:
    if args.list:
        from specwatch.lab.simulation.simulator import SCENARIOS

        width = max(len(name) for name in SCENARIOS)
        for name, description in SCENARIOS.items():
            print(f"{name:<{width}}  {description}")
        return 0
    if sum((bool(args.output), bool(args.bootstrap), args.otlp is not None)) != 1:
        raise CommandError("error: give --output FILE or --bootstrap HOST:PORT or --otlp [ENDPOINT], one of them "
                           "(or --list)")
    if args.rate < 0:
        raise CommandError(f"error: --rate must be >= 0, got {args.rate}")
    from specwatch.lab.simulation.simulator import Simulator

    try:
        simulator = Simulator(args.scenario, seed=args.seed, minutes=args.minutes,
                              workers=args.workers, intensity=args.intensity,
                              incident_at=args.incident_at)
    except ValueError as error:
        raise CommandError(f"error: {error}") from None
    if args.bootstrap or args.otlp is not None:
        return _run_exporter(args, simulator)
    from specwatch.commands._arguments import open_command_output
    from specwatch.outputs import writes_stdout
    from specwatch.schemas import encode_record

    counts: Counter = Counter()
    try:
        with open_command_output(args.output, args) as stream:
            for record in simulator.records():
                stream.write(encode_record(record) + "\n")
                counts[record.kind] += 1
    except OSError as error:
        raise CommandError(f"error: cannot write {args.output}: {error.strerror or error}", _EXIT_IO) from None
    destination = "stdout" if writes_stdout(args.output) else args.output
    print(summary_line(simulator, counts, destination), file=sys.stderr)
    return 0


def _run_exporter(args: argparse.Namespace, simulator) -> int:
    """Send to Kafka (``--bootstrap``) or to an OpenTelemetry Collector (``--otlp``); report what arrived."""
    if args.bootstrap:
        from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
        from specwatch.transport.config import BrokerUnavailable, KafkaConfig
        from specwatch.transport.clients import probe_bootstrap

        try:
            probe_bootstrap(args.bootstrap, _CONNECT_TIMEOUT_S)
        except BrokerUnavailable as error:
            raise CommandError(f"error: {error}") from None
        destination, where = f"kafka {args.bootstrap} topic {args.topic}", ""

        def exporter():
            return KafkaTelemetryExporter(KafkaConfig.from_env(args.bootstrap, topic=args.topic,
                                                               client_id="specwatch-simulate"))
    else:
        from specwatch.collectors.otlp_export import OtlpTelemetryExporter, otlp_log_exporter

        endpoint = (args.otlp or os.environ.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the default endpoint")
        destination, where = f"OTLP {endpoint}", f" to {endpoint}"

        def exporter():  # the OTEL_* variables configure it; ENDPOINT replaces the base endpoint
            return OtlpTelemetryExporter(otlp_log_exporter(endpoint=args.otlp or None))
    try:
        counts, stats = send(simulator.records(), exporter(), args.rate)
    except ValueError as error:
        raise CommandError(f"error: {error}") from None
    print(summary_line(simulator, counts, destination), file=sys.stderr)
    rate = sum(counts.values()) / max(stats["seconds"], 1e-9)
    if args.bootstrap:
        sent = f"{stats['messages']} messages, {stats['bytes']} bytes"
        failures = f"({stats['send_errors']} send errors, {stats['delivery_errors']} delivery errors)"
    else:
        sent = f"{stats['requests']} OTLP requests, {stats['records']} records"
        failures = f"({stats['failed_requests']} failed requests); is a Collector listening there?"
    print(f"simulate: {sent} in {stats['seconds']:g} s ({rate:.0f} records/s)", file=sys.stderr)
    lost = stats["records_failed"] + stats["dropped"]
    if lost:
        raise CommandError(f"error: {lost} records were not delivered{where} {failures}", _EXIT_IO)
    return 0
