"""`specwatch query`: the archive for postmortems, as tables or JSON Lines; SQL is read-only."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Sequence, TextIO

from specwatch.analysis.postmortem import format_pairs
from specwatch.commands._arguments import (CommandError, EXIT_NOT_FOUND, archive_reader_options,
                                           open_archive)

__all__ = ["DESCRIPTION", "add_arguments", "parse_time", "print_rows", "format_card",
           "format_number", "format_optional", "format_scope", "format_ts"]

_DEFAULT_AROUND_S = 120.0
_NO_ROWS = "0 rows"

Column = tuple[str, str, Callable[[Any], str]]  # (key, header, formatter)


DESCRIPTION = ("Read the specwatch archive: decisions and why they were made, the samples "
               "kept with them, window statistics around them, bundles, and read-only SQL.")


def add_arguments(parser) -> None:
    common = archive_reader_options()
    span = argparse.ArgumentParser(add_help=False)
    for name in ("--since", "--until"):
        span.add_argument(name, type=parse_time, metavar="T",
                          help="unix seconds or ISO-8601 time (inclusive)")
    sub = parser.add_subparsers(dest="query_command", metavar="WHAT", required=True)

    p = sub.add_parser("decisions", parents=[common, span], help="decisions in time order")
    p.add_argument("--bundle", help="bundle id")
    p.add_argument("--bucket", help="task bucket ('*' = whole-bundle decisions)")
    p.add_argument("--reason", help="decision reason, e.g. acceptance_drop")
    p.add_argument("--action", help="decision action, e.g. disable_speculation")
    p.add_argument("--limit", type=int, default=100, help="most recent N (default 100; 0 = all)")
    p.set_defaults(func=_decisions)

    p = sub.add_parser("decision", parents=[common], help="one decision with its audit evidence")
    p.add_argument("decision_id")
    p.set_defaults(func=_decision)

    p = sub.add_parser("samples", parents=[common], help="the reproducible samples kept with a decision")
    p.add_argument("decision_id")
    p.set_defaults(func=_samples)

    p = sub.add_parser("timeline", parents=[common, span], help="window statistics per slice")
    p.add_argument("--bundle", help="bundle id (default: the bundle of --around)")
    p.add_argument("--bucket", help="task bucket (default: the bucket of --around; '*' = whole bundle)")
    p.add_argument("--cohort", help="cohort")
    p.add_argument("--around", metavar="DECISION_ID", help="center on a decision")
    p.add_argument("--seconds", type=float, default=_DEFAULT_AROUND_S,
                   help=f"how far either side of --around (default {_DEFAULT_AROUND_S:g})")
    p.set_defaults(func=_timeline)

    p = sub.add_parser("bundles", parents=[common], help="bundles seen, with their cards")
    p.set_defaults(func=_bundles)

    p = sub.add_parser("sql", parents=[common], help="one read-only SQL statement",
                       description="Run one SELECT, WITH, SHOW or DESCRIBE statement on the archive. "
                                   "Table names resolve in the archive's database (`specwatch` unless "
                                   "the DSN names another), so SHOW TABLES lists the archive's tables.")
    p.add_argument("statement")
    p.add_argument("--max-seconds", type=float, metavar="S",
                   help="stop the statement after S seconds (ClickHouse max_execution_time; default 30)")
    p.add_argument("--max-rows", type=int, metavar="N",
                   help="refuse a result of more than N rows (ClickHouse max_result_rows; default 100000)")
    p.add_argument("--max-memory-mib", type=int, metavar="MIB",
                   help="stop the statement past MIB MiB of memory (ClickHouse max_memory_usage; default 2048)")
    p.set_defaults(func=_sql)


def parse_time(text: str) -> float:
    """Unix seconds from ``1717171717.5`` or an ISO-8601 time (UTC unless it says otherwise).

    >>> parse_time("90.5"), parse_time("1970-01-01T00:01:30Z"), parse_time("1970-01-01 00:01:30")
    (90.5, 90.0, 90.0)
    """
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither unix seconds nor an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def format_ts(ts: float | None) -> str:
    """A unix time as UTC with milliseconds.

    >>> format_ts(90.25)
    '1970-01-01 00:01:30.250'
    """
    if ts is None or (isinstance(ts, float) and not math.isfinite(ts)):
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def print_rows(rows: Iterable[dict], columns: Sequence[Column], as_json: bool,
               out: TextIO | None = None, empty: str | None = None) -> int:
    """Rows as an aligned table (numbers right-aligned) or as JSON Lines; returns the count.

    ``empty`` is the text form of no rows (JSON Lines of no rows are no lines).

    >>> print_rows([{"a": "x", "n": 1.5}, {"a": "long", "n": float("nan")}],
    ...            [("a", "A", str), ("n", "N", format_number(2))], as_json=False, out=sys.stdout)
    A        N
    x     1.50
    long     -
    2
    """
    out = out or sys.stdout
    rows = list(rows)
    try:
        if rows or as_json or empty is None:
            _write_rows(rows, columns, as_json, out)
        else:
            out.write(empty + "\n")
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep the interpreter's
        # final flush from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return len(rows)


def _write_rows(rows: list[dict], columns: Sequence[Column], as_json: bool, out: TextIO) -> None:
    if as_json:
        from specwatch.archive.jsonvalue import plain

        for row in rows:
            # NaN and infinities as null: JSON Lines readers choke on bare NaN.
            out.write(json.dumps(plain(row), separators=(",", ":"), default=str) + "\n")
        return
    headers = [header for _, header, _ in columns]
    cells = [[fmt(row.get(key)) for key, _, fmt in columns] for row in rows]
    right = [any(_is_number(row.get(key)) for row in rows)
             and all(_is_number(row.get(key)) or row.get(key) is None for row in rows)
             for key, _, _ in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return "  ".join(parts).rstrip()

    out.write(line(headers) + "\n")
    for row_cells in cells:
        out.write(line(row_cells) + "\n")


def _decisions(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        rows = archive.decisions(bundle_id=args.bundle, bucket=args.bucket, reason=args.reason,
                                 action=args.action, since=args.since, until=args.until,
                                 limit=args.limit or None)
    print_rows(rows, [
        ("ts", "time (UTC)", format_ts), ("decision_id", "decision", str), ("bundle_id", "bundle", str),
        ("bucket", "bucket", format_scope), ("cohort", "cohort", format_scope), ("action", "action", str),
        ("reason", "reason", str), ("detector", "detector", str),
        ("evidence", "evidence", lambda e: format_pairs(e, limit=4)),
    ], args.json, empty=_NO_ROWS)
    return 0


def _decision(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        found = archive.decision(args.decision_id)
        samples = archive.samples(args.decision_id) if found else []
    if found is None:
        raise _no_decision(args.decision_id)
    found["sample_counts"] = dict(Counter(s["kind"] for s in samples))
    if args.json:
        print_rows([found], (), as_json=True)
        return 0
    from specwatch.schemas.scope import scope_text

    scope = scope_text((found["bundle_id"], found["bucket"], found["cohort"]))
    out = [f"decision  {found['decision_id']}  at {format_ts(found['ts'])} UTC  scope {scope}",
           f"  action    {found['action']}",
           f"  reason    {found['reason']}  (detector {found['detector']})",
           f"  evidence  {format_pairs(found['evidence']) or '-'}",
           f"  samples   {_sample_summary(found['sample_counts'])}"]
    audit = found.get("audit")
    if audit:
        out.append(f"audit     {audit['audit_id']}  by {audit['actor']}")
        out.append(f"  thresholds  {format_pairs(audit['thresholds']) or '-'}")
        out.append(f"  baseline    {format_pairs(audit['baseline']) or '-'}")
        out.append(f"  window      {_window_summary(audit['window'])}")
        out.append(f"  bundle      {format_card(audit['card'])}")
        if audit.get("detail"):
            out.append(f"  detail      {format_pairs(audit['detail'])}")
    else:
        out.append("audit     (none archived)")
    if found["sample_counts"]:
        out.append(f"see: specwatch query samples {found['decision_id']}   "
                   f"specwatch query timeline --around {found['decision_id']}")
    print("\n".join(out))
    return 0


def _samples(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        known = archive.decision(args.decision_id) is not None
        rows = archive.samples(args.decision_id)
    if not known and not rows:
        raise _no_decision(args.decision_id)
    from specwatch.analysis.postmortem import sample_summary

    for row in rows:
        if not args.json:
            row["summary"] = sample_summary(row["record"])
    print_rows(rows, [
        ("ts", "time (UTC)", format_ts), ("kind", "kind", str), ("sample_id", "sample", str),
        ("worker", "worker", format_scope), ("bucket", "bucket", format_scope), ("cohort", "cohort", format_scope),
        ("summary", "what", str),
    ], args.json, empty=f"no samples archived with decision {args.decision_id}")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        bundle, bucket, since, until, center = args.bundle, args.bucket, args.since, args.until, None
        if args.around:
            found = archive.decision(args.around)
            if found is None:
                raise _no_decision(args.around)
            center = found["ts"]
            bundle = bundle or found["bundle_id"]
            if bucket is None and found["bucket"] is not None:
                bucket = found["bucket"]
            since = center - args.seconds if since is None else since
            until = center + args.seconds if until is None else until
        if not bundle:
            raise CommandError("timeline needs --bundle (or --around DECISION_ID)")
        rows = archive.timeline(bundle_id=bundle, bucket=bucket, cohort=args.cohort, since=since,
                                until=until)
        if not rows and not archive.knows_bundle(bundle):
            raise CommandError(f"no bundle {bundle!r} in the archive", EXIT_NOT_FOUND)
    if center is not None:
        # The first slice ending at or after the decision is the one that tipped it.
        tipping = next((row["ts"] for row in rows if row["ts"] >= center), None)
        for row in rows:
            row["mark"] = "<" if row["ts"] == tipping else ""
    columns = [
        ("ts", "slice end (UTC)", format_ts), ("bucket", "bucket", format_scope), ("cohort", "cohort", format_scope),
        ("speculation_on", "spec", lambda v: "on" if v else "off"), ("rounds", "rounds", str),
        ("acceptance_length", "AL", format_number(2)),
        ("draft_overhead", "draft ovh", format_number(3)), ("speedup", "speedup", format_number(2)),
        ("ttft_p99", "ttft p99", format_number(1)), ("tpot_p99", "tpot p99", format_number(1)),
        ("e2e_p99", "e2e p99", format_number(0)), ("error_rate", "errors", format_number(3)),
        ("kv_peak", "kv peak", format_number(2)),
    ]
    if center is not None:
        columns.append(("mark", "", str))
    print_rows(rows, columns, args.json, empty=_NO_ROWS)
    if center is not None and rows and not args.json:
        print(f"(< marks the slice that tipped the decision at {format_ts(center)} UTC)")
    return 0


def _bundles(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        rows = archive.bundles()
    for row in [] if args.json else rows:  # JSON keeps the archive's fields
        row["summary"] = format_card(row["card"])
        row["worker_count"] = len(row["workers"])
    print_rows(rows, [
        ("bundle_id", "bundle", str), ("first_seen", "first seen (UTC)", format_ts),
        ("last_seen", "last seen (UTC)", format_ts), ("worker_count", "workers", str),
        ("summary", "card", str),
    ], args.json, empty="no bundle in the archive yet")
    return 0


def _sql(args: argparse.Namespace) -> int:
    from specwatch.archive.errors import ArchiveError, ArchiveQueryLimit

    archive = open_archive(args.archive_dsn)
    limits = {name: value for name, value in (("max_seconds", args.max_seconds), ("max_rows", args.max_rows),
                                              ("max_memory_mib", args.max_memory_mib))
              if value is not None}
    with archive:
        try:
            names, rows = archive.sql(args.statement, **limits)
        except ValueError as exc:
            raise CommandError(f"refused: {exc}") from None
        except ArchiveQueryLimit as exc:
            option = {"max_execution_time": "--max-seconds", "max_memory_usage": "--max-memory-mib"}.get(
                exc.setting, "--max-rows")
            message = f"{exc}; narrow the statement or raise {option}"
            raise CommandError(message, EXIT_NOT_FOUND) from None
        except ArchiveError as exc:
            raise CommandError(str(exc), EXIT_NOT_FOUND) from None
    dicts = [dict(zip(names, row)) for row in rows]
    print_rows(dicts, [(name, name, _cell) for name in names], as_json=args.json, empty=_NO_ROWS)
    return 0


def _no_decision(decision_id: str) -> CommandError:
    return CommandError(f"no decision {decision_id!r} in the archive", EXIT_NOT_FOUND)


def format_number(digits: int, missing: str = "-") -> Callable[[Any], str]:
    """A column formatter: ``digits`` after the point, ``missing`` for None and NaN."""
    def fmt(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return missing
        return f"{value:.{digits}f}"
    return fmt


def format_scope(value: Any) -> str:
    """A scope's bucket or cohort, ``*`` for all."""
    return "*" if value is None else str(value)


def format_optional(value: Any) -> str:
    """``-`` for None, floats as short as they go."""
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sample_summary(counts: dict[str, int]) -> str:
    if not counts:
        return "none"
    total = sum(counts.values())
    return f"{total} (" + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) + ")"


def _window_summary(window: Any) -> str:
    """One line over the evidence slices: span, and how AL and speedup moved."""
    if not isinstance(window, list) or not window:
        return "-"
    slices = [w for w in window if isinstance(w, dict)]
    ends = [w.get("slice_end", w.get("ts")) for w in slices]
    ends = [t for t in ends if isinstance(t, (int, float))]
    span = f"{len(slices)} slices" + (f" {format_ts(min(ends))} .. {format_ts(max(ends))}" if ends else "")

    def move(key: str, label: str) -> str | None:
        values = [w.get(key) for w in slices]
        values = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
        return f"{label} {values[0]:.2f} -> {values[-1]:.2f}" if values else None

    moves = [m for m in (move("acceptance_length", "AL"), move("speedup", "speedup"),
                         move("tpot_p99", "tpot p99")) if m]
    return "; ".join([span] + moves)


def format_card(card: Any) -> str:
    """A bundle card in one line: target, drafter and D, runtime, acceptance rule."""
    if not isinstance(card, dict):
        return "-"
    target, drafter, runtime = (card.get(k) or {} for k in ("target", "drafter", "runtime"))
    parts = []
    if target:
        quantization = target.get("quantization")
        parts.append(f"target {target.get('model_id', '?')}@{target.get('revision') or '-'}"
                     + (f" {quantization}" if quantization not in (None, "", "none") else ""))
    if drafter:
        parts.append(f"drafter {drafter.get('mechanism', '?')}@{drafter.get('revision') or '-'} "
                     f"D={drafter.get('draft_length', '?')}")
    if runtime:
        parts.append(" ".join(str(runtime[k]) for k in ("engine", "gpu", "parallelism") if runtime.get(k)))
    parts.append((card.get("policy") or {}).get("acceptance_rule") or "")
    return "; ".join(p for p in parts if p) or "-"
