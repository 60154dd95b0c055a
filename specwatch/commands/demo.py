"""`specwatch demo`: a simulated fleet through the whole pipeline, closed loop, incidents caught."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option, add_policy_option,
                                           check_output, load_policy)

__all__ = ["DESCRIPTION", "add_arguments", "run", "run_simulated_demo"]

_DEFAULT_OUTDIR = "specwatch-data"


DESCRIPTION = ("Simulate a fleet of speculative engine workers with scripted incidents, detect them, "
               "switch the affected paths to standard decoding, archive the evidence and draw a timeline.")


def add_arguments(parser) -> None:
    add_json_option(parser, help="end with one JSON object on stdout")
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="sim: simulated fleet (default); vllm: a real vLLM engine on tiny models")
    parser.add_argument("--scenario", default="demo", help="simulator scenario (see `specwatch simulate --list`)")
    parser.add_argument("--minutes", type=float, default=None, help="simulated minutes (scenario default)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=8)
    add_policy_option(parser, help="policy TOML file (defaults built in; with --engine vllm, a policy whose "
                                   "minimums fit its short run)")
    parser.add_argument("--outdir", default=os.environ.get("SPECWATCH_DEMO_DIR", _DEFAULT_OUTDIR),
                        help="where the timeline picture goes (default ./specwatch-data)")
    add_archive_option(parser, help="archive DSN (default: $SPECWATCH_ARCHIVE or chdb://<outdir>/archive)")
    parser.add_argument("--no-archive", action="store_true", help="skip the ClickHouse archive")
    parser.add_argument("--otel-sdk", action="store_true",
                        help="emit through the OpenTelemetry SDK LoggerProvider (slower) instead of the "
                             "emitter's direct path; both produce the same records")
    parser.add_argument("--serve", type=int, metavar="PORT",
                        help="serve the Prometheus metrics a `specwatch run` worker serves on "
                             "http://127.0.0.1:PORT/metrics while the demo runs, and after it until interrupted")


def run_simulated_demo(scenario: str = "demo", seed: int = 7, minutes: float | None = None, workers: int = 8,
                       policy=None, archive_sink=None, picture: Path | None = None, progress=None,
                       sdk: bool = False, operations=None) -> dict:
    """Simulate, detect, act (closed loop), archive and draw; returns a summary dict.
    ``archive_sink`` gets every slice's output (the caller closes it), ``operations`` what a
    worker's metrics see."""
    from specwatch.actions.flags import FlagStore
    from specwatch.collectors.export import CallbackExporter
    from specwatch.collectors.otel import TelemetryEmitter
    from specwatch.lab.evaluation.scoring import decision_alarm, match_incidents
    from specwatch.lab.simulation.simulator import Simulator
    from specwatch.streams.embedded import EmbeddedPipeline

    flags = FlagStore()
    rows: list[dict] = []
    sinks = [lambda out: rows.extend(out.window_rows), archive_sink, operations and operations.view.observe]
    pipeline = EmbeddedPipeline(policy, flags=flags, sinks=[sink for sink in sinks if sink is not None])
    if operations is not None:
        from specwatch.streams.metrics import ServiceHealth

        operations.view.stages = lambda: [pipeline.stage2]
        operations.health = lambda: ServiceHealth(records_read=pipeline.counters.records,
                                                  records_rejected=pipeline.counters.rejected.as_dict(),
                                                  decisions_published=pipeline.counters.decisions)
    sim = Simulator(scenario, seed=seed, minutes=minutes, workers=workers, flags=flags)
    # flushed every simulated second: decisions reach the engines as over the decisions topic
    emitter = TelemetryEmitter(CallbackExporter(pipeline.feed_many), sdk=sdk)
    started = time.monotonic()
    next_report = next_flush = sim.start_ts
    mismatches: dict[str, list[float]] = defaultdict(list)  # strict shadow mismatches, for the picture
    for record in sim.records():
        if record.kind == "shadow" and not record.match:
            mismatches[record.bucket].append(record.ts)
        emitter.emit(record)
        if record.ts >= next_flush:
            emitter.force_flush()
            next_flush = record.ts + 1.0
        if progress is not None and record.ts >= next_report:
            progress(record.ts - sim.start_ts, sim.duration, pipeline)
            next_report = record.ts + 30.0
    emitter.force_flush()
    emitter.shutdown()
    dropped = emitter.stats().dropped
    pipeline.finish()
    wall = time.monotonic() - started
    decisions = pipeline.decisions
    matched = match_incidents(sim.incidents, [decision_alarm(d) for d in decisions])
    summary = {
        "start_ts": sim.start_ts, "simulated_seconds": sim.duration, "wall_seconds": round(wall, 2),
        "counters": dict(pipeline.counters.as_dict(), emitter_dropped=dropped),
        "buckets": _bucket_table(rows),
        "decisions": [json.loads(d.to_json_line()) for d in decisions],
        "decision_ids": [d.id for d in decisions],
        "incidents": matched,
    }
    if picture is not None:
        from specwatch.analysis.timeline import render_timeline

        render_timeline(rows, decisions, picture, incidents=sim.incidents,
                        title=f"specwatch demo: scenario '{scenario}', seed {seed}",
                        shadow_mismatches=mismatches, kv_watermark=pipeline.policy.kv.watermark)
        summary["picture"] = str(picture)
    return summary


def _bucket_table(rows: list[dict]) -> list[dict]:
    """Per bucket, speculative cohorts: AL, draft overhead, speedup (round-weighted), typical p99."""
    by_bucket: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("bucket") is not None and row["rounds"]:
            by_bucket[row["bucket"]].append(row)
    table = []
    for bucket, group in sorted(by_bucket.items()):
        rounds = sum(row["rounds"] for row in group)

        def mean(name: str, digits: int) -> float:
            weighted = sum(row[name] * row["rounds"] for row in group if _measured(row[name]))
            return round(weighted / rounds, digits)

        p99s = [row["e2e_p99"] for row in group if _measured(row["e2e_p99"])]
        table.append({"bucket": bucket, "rounds": rounds,
                      "acceptance_length": mean("acceptance_length", 3),
                      "draft_overhead": mean("draft_overhead", 4), "speedup": mean("speedup", 3),
                      "e2e_p99_ms": round(statistics.median_high(p99s), 1) if p99s else None})
    return table


def _measured(value) -> bool:
    return value is not None and not math.isnan(value)


def _print_report(summary: dict, stream) -> None:
    from specwatch.commands.query import format_number as digits, print_rows

    start = summary["start_ts"]
    print("", file=stream)
    print_rows(summary["buckets"], [
        ("bucket", "bucket", str), ("rounds", "rounds", str),
        ("acceptance_length", "AL", digits(2)),
        ("draft_overhead", "draft ovh", lambda share: f"{share * 100:.1f}%"),
        ("speedup", "speedup", digits(2)), ("e2e_p99_ms", "e2e p99 ms", digits(0)),
    ], as_json=False, out=stream)
    print("(e2e p99: median over 1 s windows of the speculative cohorts)\n", file=stream)
    print_rows([dict(d, t=d["ts"] - start, decision_id=ident, scope=_scope(d))
                for d, ident in zip(summary["decisions"], summary["decision_ids"])], [
        ("t", "t (s)", digits(1)), ("decision_id", "decision", str), ("action", "action", str),
        ("reason", "reason", str), ("scope", "scope", str),
    ], as_json=False, out=stream)
    print("", file=stream)
    print_rows([dict(row, scope=_scope(row), starts=row["start_ts"] - start, caught=_caught(row))
                for row in summary["incidents"]], [
        ("incident", "incident", str), ("scope", "scope", str), ("starts", "starts (s)", digits(1)),
        ("caught", "caught as", str), ("detection_delay_s", "delay (s)", digits(1, "missed")),
    ], as_json=False, out=stream)
    counters = summary["counters"]
    print(f"\n{counters['records']} records, {counters['rejected']} rejected, "
          f"{counters['slices']} slices, {summary['simulated_seconds']:.0f} simulated s in "
          f"{summary['wall_seconds']:.1f} s", file=stream)
    if summary.get("archive"):
        print(f"archive: {summary['archive']}   (try: specwatch query decisions --archive {summary['archive']})",
              file=stream)
    if summary.get("picture"):
        print(f"timeline: {summary['picture']}", file=stream)


def _scope(row: dict) -> str:
    return f"{row['bucket'] or '*'}/{row['cohort'] or '*'}"


def _caught(incident: dict) -> str:
    """The incident's own decision: its reason and scope, and the verdict when it is not right.

    >>> _caught({"decision_id": "d-1", "verdict": "right", "reason": "error_rate",
    ...          "decision_bucket": "extraction", "decision_cohort": "main"})
    'error_rate on extraction/main'
    >>> _caught({"decision_id": None, "verdict": "missed"})
    '-'
    """
    if incident["decision_id"] is None:
        return "-"
    verdict = incident["verdict"]
    scope = _scope({"bucket": incident.get("decision_bucket"), "cohort": incident.get("decision_cohort")})
    caught = f"{incident['reason']} on {scope}"
    return caught if verdict == "right" else f"{caught} ({verdict})"


def run(args) -> int:
    policy = load_policy(args.policy)
    if policy.capture.enabled:
        # Never ignored silently: an operator who asked for sealed samples would find none.
        raise CommandError(f"{args.policy} turns on [capture], which the demo cannot honour: the simulated "
                           "fleet has no token ids to seal and the vLLM demo builds its own collector; "
                           "capture runs in a serving engine (SPECWATCH_VLLM_POLICY); remove [capture] or set "
                           "enabled = false")
    outdir = Path(args.outdir)
    picture = outdir / "timeline.png"
    archive_sink = None
    dsn = None
    if not args.no_archive:
        default = outdir / ("vllm/archive" if args.engine == "vllm" else "archive")
        dsn = args.archive or os.environ.get("SPECWATCH_ARCHIVE") or f"chdb://{default}"
    if args.engine != "vllm":
        check_output(str(picture), _reads(args, dsn))  # before anything is written
    outdir.mkdir(parents=True, exist_ok=True)
    if dsn is not None:
        from specwatch.archive.sink import ArchiveSink

        try:
            archive_sink = ArchiveSink.open(dsn, outage_log_level=logging.INFO)
        except ValueError as error:
            raise CommandError(str(error)) from None
    if args.engine == "vllm":
        return _run_vllm(args, outdir, policy if args.policy else None, archive_sink, dsn)
    report = sys.stderr if args.json else sys.stdout

    def progress(elapsed, total, pipeline):
        counters = pipeline.counters
        print(f"  t={elapsed:6.0f}/{total:.0f} s  records={counters.records:>8}  decisions={counters.decisions}",
              file=sys.stderr, flush=True)

    operations, port = _serve(args.serve) if args.serve is not None else (None, None)
    if args.serve is not None and operations is None:
        return 2
    try:
        summary = run_simulated_demo(args.scenario, args.seed, args.minutes, args.workers, policy, archive_sink,
                                     picture, progress, sdk=args.otel_sdk, operations=operations)
    finally:
        if archive_sink is not None:
            archive_sink.close()
    if archive_sink is not None:
        summary["archive"] = _archived_at(archive_sink, dsn)
    _print_report(summary, report)
    if args.json:
        shown = ("decisions", "decision_ids", "incidents", "archive", "picture", "counters", "buckets")
        print(json.dumps({key: summary.get(key) for key in shown}, sort_keys=True))
    if operations is not None:
        print(f"serving metrics on http://127.0.0.1:{port}/metrics until interrupted (Ctrl-C)",
              file=sys.stderr, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _reads(args, dsn: str | None) -> argparse.Namespace:
    """The demo's arguments as the output check reads them: the archive is the one the demo opens
    (under --outdir unless --archive or $SPECWATCH_ARCHIVE names another), none with --no-archive."""
    reads = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("archive", "archive_dsn")})
    if dsn is not None:
        reads.archive = dsn
    return reads


def _archived_at(archive_sink, dsn: str) -> str | None:
    """The DSN when the archive holds the whole run; else None, after saying on stderr where the rows are."""
    note = archive_sink.delivery_note()
    if note:
        print(f"specwatch demo: {note}", file=sys.stderr)
    return None if archive_sink.stats()["spool_pending_bytes"] or archive_sink.stats()["dropped_entries"] else dsn


def _serve(port: int):
    """An `Operations` whose metrics prometheus-client serves on ``port`` (0: a free one), and the
    port it bound (what to print); (None, None), after saying why, if it cannot."""
    from prometheus_client import start_http_server

    from specwatch.streams.operations import Operations, OperationsSettings

    operations = Operations(OperationsSettings(web_port=None))
    try:
        server, _ = start_http_server(port, addr="127.0.0.1", registry=operations.registry)
    except (OSError, OverflowError) as error:
        print(f"specwatch demo: cannot serve metrics on port {port}: {error}; pick a free port", file=sys.stderr)
        return None, None
    bound = server.server_port
    print(f"specwatch demo: metrics on http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
    return operations, bound


def _run_vllm(args, outdir: Path, policy, archive_sink=None, dsn: str | None = None) -> int:
    """The vLLM engine's telemetry through the embedded pipeline; its decisions reach the engine.
    ``policy`` None: the demo's, with minimums scaled to its short run."""
    try:
        from specwatch.lab.demo.vllm_demo import run_vllm_demo, vllm_demo_policy
    except ImportError as error:
        print(f"specwatch demo --engine vllm: the vLLM integration is not available ({error}); "
              "install it with deploy/bootstrap.sh --with-vllm", file=sys.stderr)
        return 2
    from specwatch.streams.embedded import EmbeddedPipeline

    pipeline = EmbeddedPipeline(policy if policy is not None else vllm_demo_policy(), clock=time.time,
                                sinks=[archive_sink] if archive_sink is not None else [])
    try:
        summary = run_vllm_demo(json_output=args.json, workdir=outdir / "vllm", on_record=pipeline.feed,
                                flags=pipeline.flags, finish=pipeline.finish)
    finally:
        if archive_sink is not None:
            archive_sink.close()
    summary["counters"] = pipeline.counters.as_dict()
    if archive_sink is not None:
        summary["archive"] = _archived_at(archive_sink, dsn)
        if not args.json and summary["archive"]:
            print(f"archive: {dsn}   (try: specwatch query decisions --archive {dsn})")
    if args.json:
        print(json.dumps(summary, sort_keys=True, default=str))
    return 0
