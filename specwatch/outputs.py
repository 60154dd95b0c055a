"""Files the commands write: never one of the command's own inputs, and never left half written."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterator, Sequence

__all__ = ["OutputClashError", "check_not_an_input", "atomic_output"]

STDIO = "-"


class OutputClashError(ValueError):
    """An output path names a file the same command reads."""


def check_not_an_input(output: str, inputs: Sequence[str | None]) -> None:
    """Raise `OutputClashError` when ``output`` is the same file as one of ``inputs``.

    Same file means the same inode, whatever the spelling: ``X``, ``./X``, a symlink or a
    hard link to X. ``-`` (stdin/stdout) and inputs that do not exist never clash.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> x = os.path.join(d, "t.jsonl"); open(x, "w").close()
    >>> check_not_an_input(os.path.join(d, ".", "t.jsonl"), [x])
    Traceback (most recent call last):
    ...
    specwatch.outputs.OutputClashError: the output ... is the input ...; write the output to another file
    >>> check_not_an_input(os.path.join(d, "out.jsonl"), [x, None, "-"])
    """
    if output == STDIO:
        return
    for source in inputs:
        if not source or source == STDIO:
            continue
        try:
            same = os.path.samefile(output, source)
        except OSError:  # either does not exist (yet): nothing to overwrite
            same = False
        if same:
            raise OutputClashError(f"the output {output} is the input {source}; write the output to another file")


@contextlib.contextmanager
def atomic_output(path: str, *, inputs: Sequence[str | None] = (), encoding: str = "utf-8") -> Iterator[IO[str]]:
    """A text stream for ``path`` (``-``: stdout) that replaces the file (a symlink's target, keeping
    its mode) only on success; `OutputClashError` before anything is written if ``path`` is an input."""
    if path == STDIO:
        yield sys.stdout
        return
    check_not_an_input(path, inputs)
    target = Path(os.path.realpath(path))
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:  # name the file asked for, not the temporary one
        raise OSError(error.errno, error.strerror, path) from None
    try:
        try:
            mode = os.stat(target).st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
        with open(fd, "w", encoding=encoding) as stream:
            yield stream
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
