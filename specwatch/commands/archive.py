"""`specwatch archive flush`: deliver the rows an earlier run spooled while its archive was down."""

from __future__ import annotations

import logging
import sys

from specwatch.commands._arguments import EXIT_USAGE, add_archive_option

__all__ = ["DESCRIPTION", "add_arguments"]

_EXIT_STILL_SPOOLED = 1  # the archive is still away, or another flush is delivering the spool now
_EXIT_SET_ASIDE = 3  # entries that can never be delivered as they are wait for a person


DESCRIPTION = ("Rows that `replay`, `demo` or `run` could not write to the archive wait in a local "
               "spool (one per archive, under $SPECWATCH_ARCHIVE_SPOOL or "
               "~/.cache/specwatch/archive-spool). The next run with the same archive delivers them; "
               "`flush` delivers them now. Entries that cannot be delivered (a torn or corrupt frame, "
               "content that is not a row) are kept in *.bad files beside the segments and reported "
               "with exit code 3 until someone removes them.")


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="archive_command", metavar="ACTION", required=True)
    p = sub.add_parser("flush", help="write the spooled rows to the archive now (idempotent)")
    add_archive_option(p)
    p.set_defaults(func=_flush)


def _flush(args) -> int:
    from specwatch.archive.sink import ArchiveSink, spool_dir_for
    from specwatch.archive.spool import Spool, SpoolBusy, describe_kinds

    try:
        spool = Spool(spool_dir_for(args.archive_dsn))
    except ValueError as error:
        print(f"specwatch archive flush: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        spool.hold()  # before the archive is opened: a second flush stops here, not on the archive's lock
    except SpoolBusy as error:
        print(f"specwatch archive flush: {error}; nothing done, run it again once that one ends", file=sys.stderr)
        return _EXIT_STILL_SPOOLED
    try:
        code = 0
        if spool.empty:  # nothing to deliver: do not create an archive for it
            print(f"nothing spooled in {spool.directory}")
        else:
            sink = ArchiveSink.open(args.archive_dsn, spool=spool, outage_log_level=logging.INFO)
            sink.close()
            stats = sink.stats()
            if stats["spool_pending_bytes"]:
                print(f"specwatch archive flush: {sink.delivery_note()}", file=sys.stderr)
                return _EXIT_STILL_SPOOLED
            print(f"{stats['replayed']} spooled entries delivered to the archive")
        for kept in spool.set_aside_files():
            print(f"specwatch archive flush: error: {sum(kept.kinds.values())} spooled entries could not be "
                  f"delivered ({describe_kinds(kept.kinds)}): torn, corrupt or not rows; kept in {kept.path} "
                  "for a person to look at (remove it once done)", file=sys.stderr)
            code = _EXIT_SET_ASIDE
        return code
    finally:
        spool.close()
