"""The `specwatch` command line: discovers subcommands in `specwatch.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from specwatch import __version__, commands

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwatch",
        description="Monitor speculative decoding and switch it off where it stops paying.",
    )
    parser.add_argument("--version", action="version", version=f"specwatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
