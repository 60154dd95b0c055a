"""Options several commands take, and the error that ends a command with one line (kept light)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import IO, TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from specwatch.archive.dsn import ArchiveDsn

__all__ = ["CommandError", "EXIT_NOT_FOUND", "EXIT_NOT_PUBLISHED", "EXIT_USAGE",
           "actor_name", "add_archive_option", "add_json_option", "add_policy_option", "archive_reader_options",
           "check_output", "load_policy", "open_archive", "open_command_output", "write_page"]

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_NOT_PUBLISHED = 3  # a manual change was recorded, but not published
_ARCHIVE_HELP = "archive DSN (default: $SPECWATCH_ARCHIVE or chdb://specwatch-data/archive)"
_POLICY_HELP = "policy TOML file (defaults built in)"
_MAX_ACTOR_CHARS = 200


class CommandError(Exception):
    """Stops a command: `specwatch.cli.main` prints ``specwatch COMMAND: message`` and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def actor_name(text: str, option: str) -> str:
    """Who acts (``--actor``, ``--by``), stripped: printable text of at most 200 characters, so the
    audit trail holds a name, never a newline or a terminal escape sequence; else `CommandError`.

    >>> actor_name(" Ana García ", "--by")
    'Ana García'
    >>> actor_name("ops\\x1b[2Jroot", "--by")
    Traceback (most recent call last):
    ...
    specwatch.commands._arguments.CommandError: --by must be a printable name: 'ops\\x1b[2Jroot' holds U+001B
    """
    import unicodedata

    name = text.strip()
    if not name or len(name) > _MAX_ACTOR_CHARS:
        raise CommandError(f"{option} must be a name of 1 to {_MAX_ACTOR_CHARS} characters")
    for char in name:
        # Cc: control characters (newline, ESC); Cf: invisible format characters (bidi overrides)
        if unicodedata.category(char).startswith("C"):
            raise CommandError(f"{option} must be a printable name: {name!r} holds U+{ord(char):04X}")
    return name


def add_archive_option(parser: argparse.ArgumentParser, help: str = _ARCHIVE_HELP) -> None:  # noqa: A002
    """``--archive DSN``; `specwatch.cli` checks the DSN before the command runs."""
    parser.add_argument("--archive", metavar="DSN", default=None, help=help)


def archive_reader_options() -> argparse.ArgumentParser:
    """A parent parser of what archive-reading subcommands take: ``--archive`` and ``--json``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_archive_option(parser)
    add_json_option(parser, help="JSON Lines instead of a table")
    return parser


def open_archive(dsn: ArchiveDsn | str | None, create: bool = False):
    """The `Archive` at ``dsn`` (an `ArchiveDsn`, as `specwatch.cli` parsed ``--archive`` into
    ``args.archive_dsn``; None: the default); one that cannot be opened raises `CommandError`."""
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


def check_output(path: str | None, args: argparse.Namespace) -> None:
    """`CommandError` (exit 2) when ``path`` is, or lies in, anything the command reads: its input,
    policy and model config, the archive's directory, the key files the environment names.
    Called before any work, so a refused output leaves every input as it was."""
    if path is None:
        return
    from specwatch.outputs import OutputClashError, check_not_an_input

    try:
        check_not_an_input(path, *_command_inputs(args))
    except OutputClashError as error:
        raise CommandError(str(error)) from None


@contextlib.contextmanager
def open_command_output(path: str, args: argparse.Namespace, *, binary: bool = False) -> Iterator[IO]:
    """`specwatch.outputs.open_output` for a command's ``--output``/``--html``, with what it reads as inputs."""
    from specwatch.outputs import OutputClashError, open_output

    files, directories = _command_inputs(args)
    try:
        with open_output(path, inputs=files, input_dirs=directories, binary=binary) as stream:
            yield stream
    except OutputClashError as error:
        raise CommandError(str(error)) from None


def _command_inputs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The files and directories a command reads, as named on its command line and in the environment."""
    from specwatch.schemas.sealed import SAMPLE_KEY_FILE_ENV
    from specwatch.transport.signing import PREVIOUS_SIGNING_KEY_FILE_ENV, SIGNING_KEY_FILE_ENV

    files = [getattr(args, name, None) for name in ("input", "policy", "model_config", "dataset")]
    files += [os.environ.get(name) for name in (SIGNING_KEY_FILE_ENV, PREVIOUS_SIGNING_KEY_FILE_ENV,
                                                SAMPLE_KEY_FILE_ENV)]
    directories = []
    if hasattr(args, "archive"):
        from specwatch.archive.dsn import ArchiveDsn

        with contextlib.suppress(ValueError):  # a bad DSN is refused on its own, with its reason
            # parsed once by specwatch.cli; still text only where a command skips its archive
            location = ArchiveDsn.of(getattr(args, "archive_dsn", None) or args.archive).location
            if location.engine == "chdb":
                directories.append(location.path)
    return [f for f in files if f], directories


def write_page(path: str, page: str, what: str, args: argparse.Namespace) -> None:
    """``page`` to ``path`` (`specwatch.outputs.open_output`: ``-`` is stdout); a path it cannot
    write raises `CommandError`."""
    try:
        with open_command_output(path, args) as out:
            out.write(page)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from None
    from specwatch.outputs import writes_stdout

    if not writes_stdout(path):
        print(f"{what} written to {path}", file=sys.stderr)
