"""The `specwatch` command line: one table of subcommands, each built from its module only when it is asked for."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

from specwatch import __version__
from specwatch.commands._arguments import CommandError
from specwatch.streams.gc_policy import tune_collector

__all__ = ["COMMANDS", "main", "build_parser"]

# Each subcommand's line in ``specwatch --help``; its module is specwatch.commands.NAME.
COMMANDS = {
    "archive": "deliver archive rows spooled while the archive was unreachable",
    "bench": "measure throughput, latency and cost against alternatives",
    "bundles": "bundle registry: admission stages, their history, manual moves",
    "decisions": "print the decisions topic as JSON Lines",
    "demo": "run a simulated fleet with incidents through the whole pipeline",
    "evaluate": "measure detection delay and false alarms against operator baselines",
    "explain": "postmortem of one archived decision (text, or an HTML page)",
    "flags": "speculative-path state per scope; manual overrides",
    "gateway": "OpenAI-compatible proxy routing between a speculative and a standard pool",
    "qualify": "Gates 1 and 2 and the D sweep of a bundle against standard decoding, before traffic",
    "query": "read decisions, evidence, samples and timelines from the archive",
    "replay": "replay contract-v1 JSON Lines and write the decisions",
    "reproduce": "re-run a decision's sealed requests on standard and speculative decoding",
    "run": "run the stream processors on Kafka (Faust workers)",
    "simulate": "write simulated fleet telemetry (contract v1 JSON Lines)",
    "soak": "steady simulated load; checks that memory and lag stay flat",
    "tune": "best draft length per bucket: predicted speedup curve from the archive",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the command it names gets its arguments (and its module loaded)."""
    parser = argparse.ArgumentParser(
        prog="specwatch",
        description="Monitor speculative decoding and switch it off where it stops paying.",
    )
    parser.add_argument("--version", action="version", version=f"specwatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The top-level options take no values: the first word that is not an option names the command.
    wanted = None if argv is None else next((word for word in argv if not word.startswith("-")), "")
    for name, summary in COMMANDS.items():
        if wanted is not None and name != wanted:
            subparsers.add_parser(name, help=summary)
            continue
        module = importlib.import_module(f"specwatch.commands.{name}")
        sub = subparsers.add_parser(name, help=summary, description=module.DESCRIPTION)
        module.add_arguments(sub)
        if hasattr(module, "run"):
            sub.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        # The archive's HTTP driver logs every failed attempt; specwatch says once what failed.
        for name in ("urllib3.connectionpool", "clickhouse_connect.driver"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    tune_collector()  # every command folds or reads many keys' slices: see streams/gc_policy.py
    try:
        _check_archive_dsn(args, os.environ)
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"specwatch {args.command}: {error}", file=sys.stderr)
        return error.exit_code


def _check_archive_dsn(args: argparse.Namespace, environ) -> None:
    """`CommandError` when the archive DSN a command was given (``--archive`` or
    ``$SPECWATCH_ARCHIVE``) cannot name an archive; checked before any command starts work, and
    kept parsed as ``args.archive_dsn`` (an `ArchiveDsn`, None when neither names one)."""
    if not hasattr(args, "archive") or getattr(args, "no_archive", False):
        return
    from specwatch.archive.dsn import ARCHIVE_ENV, ArchiveDsn

    if args.archive is not None:
        dsn, origin = args.archive, "--archive"
    else:
        dsn, origin = environ.get(ARCHIVE_ENV) or None, f"${ARCHIVE_ENV}"
    try:
        args.archive_dsn = ArchiveDsn.parse(dsn) if dsn is not None else None
    except ValueError as error:
        if dsn:
            raise CommandError(f"{error} (from {origin})") from None
        raise CommandError(f"{origin} is empty: give chdb:///abs/path, chdb://relative/path or "
                           "http(s)://host[:port][/database]") from None


if __name__ == "__main__":
    sys.exit(main())
