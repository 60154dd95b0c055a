"""Options several commands take, and the error that ends a command with one line (kept light)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["CommandError", "EXIT_NOT_FOUND", "EXIT_NOT_PUBLISHED", "EXIT_USAGE",
           "add_archive_option", "add_json_option", "add_policy_option", "archive_reader_options",
           "load_policy", "open_archive", "write_page"]

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_NOT_PUBLISHED = 3  # a manual change was recorded, but not published
_ARCHIVE_HELP = "archive DSN (default: $SPECWATCH_ARCHIVE or chdb://specwatch-data/archive)"
_POLICY_HELP = "policy TOML file (defaults built in)"


class CommandError(Exception):
    """Stops a command: `specwatch.cli.main` prints ``specwatch COMMAND: message`` and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_archive_option(parser: argparse.ArgumentParser, help: str = _ARCHIVE_HELP) -> None:  # noqa: A002
    """``--archive DSN``; `specwatch.cli` checks the DSN before the command runs."""
    parser.add_argument("--archive", metavar="DSN", default=None, help=help)


def archive_reader_options() -> argparse.ArgumentParser:
    """A parent parser of what archive-reading subcommands take: ``--archive`` and ``--json``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_archive_option(parser)
    add_json_option(parser, help="JSON Lines instead of a table")
    return parser


def open_archive(dsn: str | None, create: bool = False):
    """The `Archive` at ``dsn`` (None: the default); one that cannot be opened raises `CommandError`."""
    from specwatch.archive.errors import ArchiveError, ArchiveNotFoundError
    from specwatch.archive.store import Archive

    try:
        return Archive.open(dsn, create=create)
    except ArchiveNotFoundError as error:
        raise CommandError(f"{error} (point --archive or $SPECWATCH_ARCHIVE at an existing archive)") from None
    except (ArchiveError, ValueError) as error:
        raise CommandError(str(error)) from None


def add_policy_option(parser: argparse.ArgumentParser, help: str = _POLICY_HELP) -> None:  # noqa: A002
    """``--policy FILE``; `load_policy` reads it."""
    parser.add_argument("--policy", metavar="FILE", help=help)


def add_json_option(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002
    """``--json``: one JSON object (or JSON Lines) instead of text for people."""
    parser.add_argument("--json", action="store_true", help=help)


def load_policy(path: str | None):
    """The `Policy` in ``path`` (None: the defaults); a file that is not one raises `CommandError`."""
    from specwatch.schemas import PolicyError, load_policy as read_policy

    try:
        return read_policy(path)
    except PolicyError as error:
        raise CommandError(str(error)) from None


def write_page(path: str, page: str, what: str) -> None:
    """``page`` to ``path`` (``-``: stdout), whole or not at all; a path it cannot write raises `CommandError`."""
    if path == "-":
        sys.stdout.write(page)
        return
    from specwatch.outputs import atomic_output

    try:
        with atomic_output(path) as out:
            out.write(page)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from None
    print(f"{what} written to {path}", file=sys.stderr)
