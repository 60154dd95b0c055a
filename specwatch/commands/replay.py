"""`specwatch replay`: contract-v1 JSON Lines in, decisions as JSON Lines out, by event time."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import stat
import sys
from codecs import BOM_UTF8
from itertools import islice
from typing import BinaryIO, Callable, Iterator

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option,
                                           add_policy_option, check_output, load_policy, open_archive,
                                           open_command_output)

__all__ = ["DESCRIPTION", "add_arguments", "line_blocks", "run", "replay_file"]

_EXIT_NO_TELEMETRY = 1
_EXIT_ARCHIVE_ROWS_LOST = 3  # decisions written, some archive rows lost
_BLOCK_LINES = 4096
_READ_BYTES = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"


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
    """Feed ``source`` (a binary stream read by `line_blocks`, or lines) in blocks, write the
    decisions to ``output``; returns the counters."""
    blocks = line_blocks(source) if hasattr(source, "read") else _in_blocks(iter(source))
    for block in blocks:
        # bytes.isspace in C finds whether there is a blank line (one has at least its newline)
        for run in _runs_between_blank_lines(block) if any(map(bytes.isspace, block)) else (block,):
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


def _in_blocks(lines: Iterator[bytes]) -> Iterator[list[bytes]]:
    while block := list(islice(lines, _BLOCK_LINES)):
        yield block


def line_blocks(stream: BinaryIO) -> Iterator[list[bytes]]:
    """The lines `read_json_lines` gives of ``stream``, in blocks of up to 4,096 for `replay_file`.

    A regular file that is not gzip is read a MiB at a time and cut into lines in C (the same
    lines, a long one kept to its first ``MAX_LINE_BYTES + 1`` bytes and the rest of it read
    and dropped); gzip and pipes go line by line through `read_json_lines`, which bounds what
    a gzip stream may inflate to and hands on each line of a pipe as it comes.

    >>> import io, os
    >>> r, w = os.pipe(); os.close(w)  # a pipe: through read_json_lines
    >>> list(line_blocks(io.BytesIO(b"a\\n\\nb"))), list(line_blocks(open(r, "rb")))
    ([[b'a\\n', b'\\n', b'b']], [])
    """
    from specwatch.schemas import read_json_lines

    try:
        regular = stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # io.BytesIO and other streams without a file
        regular = isinstance(stream, io.BytesIO)
    if regular and stream.read(0) == b"" and not _gzip(stream):
        return _plain_line_blocks(stream.read)
    return _in_blocks(iter(read_json_lines(stream)))


def _gzip(stream: BinaryIO) -> bool:
    """Whether a seekable ``stream`` starts as gzip does (it is left where it was)."""
    at = stream.tell()
    head = stream.read(len(_GZIP_MAGIC))
    stream.seek(at)
    return head == _GZIP_MAGIC


def _plain_line_blocks(read: Callable[[int], bytes], max_line_bytes: int | None = None,
                       chunk_bytes: int = _READ_BYTES) -> Iterator[list[bytes]]:
    """`read_json_lines` of plain input in blocks, read ``chunk_bytes`` at a time.

    >>> chunks = iter([b"\\xef\\xbb\\xbfab\\nc", b"defgh", b"ijk\\n\\nlm\\nno", b""])
    >>> list(_plain_line_blocks(lambda size: next(chunks), max_line_bytes=5))
    [[b'ab\\n', b'cdefgh', b'\\n', b'lm\\n', b'no']]
    """
    from specwatch.schemas.codec import MAX_LINE_BYTES

    longest = (MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes) + 1
    pending: list[bytes] = []
    head = b""  # the start of the line the last chunk ended in
    cut = False  # head holds the first `longest` bytes of a longer line: the rest of it is dropped
    first = True
    while chunk := read(chunk_bytes):
        if cut:
            end = chunk.find(b"\n")
            if end < 0:
                continue
            pending.append(head)
            head, cut, chunk = b"", False, chunk[end + 1:]
        lines = io.BytesIO(chunk).readlines()  # shares the chunk's bytes until it cuts them
        if head:  # only the first line is copied again, not the chunk
            lines[0] = head + lines[0]
        head = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        if lines and max(map(len, lines)) > longest:  # a line longer than `longest` with its newline
            lines = [line if len(line) <= longest else line[:longest] for line in lines]
        if len(head) > longest:
            head, cut = head[:longest], True
        pending += lines
        while len(pending) >= _BLOCK_LINES:
            block, first = _without_bom(pending[:_BLOCK_LINES], first), False
            del pending[:_BLOCK_LINES]
            yield block
    if head:
        pending.append(head)
    if pending:
        yield _without_bom(pending, first)


def _without_bom(block: list[bytes], first: bool) -> list[bytes]:
    """``block`` with a UTF-8 byte order mark taken off its first line if it is the input's first block."""
    if first and block[0].startswith(BOM_UTF8):
        block[0] = block[0][len(BOM_UTF8):]
    return block


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
            summary = replay_file(source, out, pipeline)
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
