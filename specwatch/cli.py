"""The `specwatch` command line: discovers subcommands in `specwatch.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from specwatch import __version__, commands
from specwatch.commands._arguments import CommandError
from specwatch.streams.gc_policy import tune_collector

__all__ = ["main", "build_parser", "archive_problem"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwatch",
        description="Monitor speculative decoding and switch it off where it stops paying.",
    )
    parser.add_argument("--version", action="version", version=f"specwatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue  # shared by the commands, not one of them
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
    problem = archive_problem(args, os.environ)
    if problem is not None:
        print(f"specwatch {args.command}: {problem}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"specwatch {args.command}: {error}", file=sys.stderr)
        return error.exit_code


def archive_problem(args: argparse.Namespace, environ) -> str | None:
    """Why the archive DSN a command was given cannot name an archive, or None.

    Every command that takes ``--archive`` is checked here, the same way, before it starts
    any work; ``$SPECWATCH_ARCHIVE`` is checked when it stands in for the option.
    """
    if not hasattr(args, "archive") or getattr(args, "no_archive", False):
        return None
    from specwatch.archive.dsn import ARCHIVE_ENV, check_archive_dsn

    if args.archive is not None:
        dsn, origin = args.archive, "--archive"
    else:
        dsn, origin = environ.get(ARCHIVE_ENV) or None, f"${ARCHIVE_ENV}"
        if dsn is None:
            return None
    try:
        check_archive_dsn(dsn)
    except ValueError as error:
        if not dsn:
            return f"{origin} is empty: give chdb:///abs/path, chdb://relative/path or http(s)://host[:port][/database]"
        return f"{error} (from {origin})"
    return None


if __name__ == "__main__":
    sys.exit(main())
