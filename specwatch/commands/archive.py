"""`specwatch archive flush`: deliver the rows an earlier run spooled while its archive was down."""

from __future__ import annotations

import logging
import sys

from specwatch.commands._arguments import EXIT_USAGE, add_archive_option

__all__ = ["DESCRIPTION", "add_arguments"]

_EXIT_STILL_SPOOLED = 1


DESCRIPTION = ("Rows that `replay`, `demo` or `run` could not write to the archive wait in a local "
               "spool (one per archive, under $SPECWATCH_ARCHIVE_SPOOL or "
               "~/.cache/specwatch/archive-spool). The next run with the same archive delivers them; "
               "`flush` delivers them now.")


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="archive_command", metavar="ACTION", required=True)
    p = sub.add_parser("flush", help="write the spooled rows to the archive now (idempotent)")
    add_archive_option(p)
    p.set_defaults(func=_flush)


def _flush(args) -> int:
    from specwatch.archive.sink import ArchiveSink, spool_dir_for
    from specwatch.archive.spool import Spool

    try:
        spool = Spool(spool_dir_for(args.archive_dsn))
    except ValueError as error:
        print(f"specwatch archive flush: {error}", file=sys.stderr)
        return EXIT_USAGE
    if spool.empty:  # nothing to deliver: do not create an archive for it
        print(f"nothing spooled in {spool.directory}")
        return 0
    sink = ArchiveSink.open(args.archive_dsn, spool=spool, outage_log_level=logging.INFO)
    sink.close()
    stats = sink.stats()
    if stats["spool_pending_bytes"]:
        print(f"specwatch archive flush: {sink.delivery_note()}", file=sys.stderr)
        return _EXIT_STILL_SPOOLED
    print(f"{stats['replayed']} spooled entries delivered to the archive")
    return 0
