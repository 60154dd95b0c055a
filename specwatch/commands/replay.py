"""`specwatch replay`: contract-v1 JSON Lines in, decisions as JSON Lines out, by event time."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from itertools import islice

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option,
                                           add_policy_option, check_output, load_policy, open_archive,
                                           open_command_output)

__all__ = ["DESCRIPTION", "add_arguments", "run", "replay_file"]

_EXIT_NO_TELEMETRY = 1
_EXIT_ARCHIVE_ROWS_LOST = 3  # decisions written, some archive rows lost
_BLOCK_LINES = 4096


DESCRIPTION = ("Replay contract-v1 telemetry (JSON Lines) through the detectors and write "
               "the decisions as JSON Lines in event-time order.")


def add_arguments(parser) -> None:
    parser.add_argument("input", help="telemetry file (JSON Lines, plain or gzipped), or - for stdin")
    parser.add_argument("--output", "-o", required=True, help="where to write decisions (JSON Lines), - for stdout")
    add_policy_option(parser)
    add_archive_option(parser, help="also archive decisions, evidence and samples to this DSN (e.g. "
                                    "chdb://specwatch-data/archive); when it is unreachable the rows spool to "
                                    "local disk and the run still exits 0")
    add_json_option(parser, help="print the summary as one JSON object")


def replay_file(source, output, pipeline) -> dict:
    """Feed ``source`` in blocks, write the decisions to ``output``; returns the counters."""
    lines = iter(source)
    while block := list(islice(lines, _BLOCK_LINES)):
        for run in _runs_between_blank_lines(block):
            if isinstance(run, int):
                # Blank lines hold no record; counted, never decoded (a file of millions of
                # newlines would otherwise cost the decoder's slow path for each of them)
                pipeline.counters.lines += run
                continue
            for decision in pipeline.feed_lines(run):
                output.write(decision.to_json_line() + "\n")
    for decision in pipeline.finish():
        output.write(decision.to_json_line() + "\n")
    return pipeline.counters.as_dict()


def _what_was_written(output: str) -> str:
    """What a failed replay left at ``output``: nothing in a file; in a stream, what it had decided."""
    from specwatch.outputs import writes_in_place

    if writes_in_place(output):
        return f"the decisions made before it were written to {output}"
    return f"nothing was written to {output}"


def _runs_between_blank_lines(block: list[bytes]) -> list[list[bytes] | int]:
    """``block`` as runs of lines that are not blank, and the counts of blank lines between them.

    >>> _runs_between_blank_lines([b"a\\n", b"\\n", b" \\r\\n", b"b\\n", b"c"])
    [[b'a\\n'], 2, [b'b\\n', b'c']]
    """
    runs: list[list[bytes] | int] = []
    for line in block:
        blank = not line.strip()
        if runs and isinstance(runs[-1], int) == blank:
            if blank:
                runs[-1] += 1
            else:
                runs[-1].append(line)
        else:
            runs.append(1 if blank else [line])
    return runs


def run(args) -> int:
    import gzip

    from specwatch.outputs import writes_stdout
    from specwatch.schemas import read_json_lines
    from specwatch.schemas.codec import DecompressionBombError
    from specwatch.streams.embedded import EmbeddedPipeline

    check_output(args.output, args)
    policy = load_policy(args.policy)
    sink = None
    if args.archive:
        from specwatch.archive.sink import ArchiveSink

        try:
            sink = ArchiveSink.open(args.archive_dsn, outage_log_level=logging.INFO)
        except ValueError as error:
            raise CommandError(str(error)) from None
    qualifications = None
    if policy.admission.enforce and policy.admission.require_qualification:
        qualifications = _qualifications(args.archive_dsn)
    pipeline = EmbeddedPipeline(policy, sinks=[sink] if sink is not None else [], qualifications=qualifications)
    try:
        with contextlib.ExitStack() as stack:
            if sink is not None:
                stack.callback(sink.close)
            source = sys.stdin.buffer if args.input == "-" else stack.enter_context(open(args.input, "rb"))
            out = stack.enter_context(open_command_output(args.output, args))
            summary = replay_file(read_json_lines(source), out, pipeline)
            if summary["records"] == 0 and summary["rejected"]:  # leaves an earlier output as it was
                reasons = ", ".join(f"{count} {reason}"
                                    for reason, count in summary["rejected_by_reason"].items())
                raise CommandError(f"{args.input} is not JSON Lines telemetry: none of its "
                                   f"{summary['lines']} lines is a contract-v1 record ({reasons}); give "
                                   "one JSON object per line, plain or gzipped; nothing was written to "
                                   f"{args.output}", _EXIT_NO_TELEMETRY)  # no record, so no decision either
    except OSError as error:
        raise CommandError(f"{error.filename or args.output}: {error.strerror or error}") from None
    except DecompressionBombError as error:
        raise CommandError(f"{args.input}: {error}, after {pipeline.counters.lines} lines; "
                           f"{_what_was_written(args.output)}", _EXIT_NO_TELEMETRY) from None
    except (gzip.BadGzipFile, EOFError) as error:
        why = error or "it ends early"
        raise CommandError(f"{args.input} is a damaged gzip file ({why}) after "
                           f"{pipeline.counters.lines} lines; {_what_was_written(args.output)}",
                           _EXIT_NO_TELEMETRY) from None
    note = sink.delivery_note() if sink is not None else None
    if note:
        print(f"specwatch replay: {note}", file=sys.stderr)
    summary["output"] = args.output
    if sink is not None:
        summary["archive"] = sink.stats()
    stream = sys.stderr if writes_stdout(args.output) else sys.stdout
    if args.json:
        print(json.dumps(summary, sort_keys=True), file=stream)
    else:
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
    return _EXIT_ARCHIVE_ROWS_LOST if sink is not None and sink.stats()["dropped_entries"] else 0


def _qualifications(dsn) -> dict:
    """Each bundle's newest qualification in the archive, for admission's require_qualification switch."""
    with open_archive(dsn) as archive:
        rows = archive.qualifications()
    return {row["bundle_id"]: {"verdict": row["verdict"], "qualification_id": row["qualification_id"],
                               "ts": row["ts"], "reasons": row["report"].get("gate1", {}).get("reasons", [])
                               + row["report"].get("gate2", {}).get("reasons", [])} for row in rows}
