"""Where the commands write: a regular file appears whole or not at all, anything else (a device,
a FIFO, stdout, a descriptor the shell opened) is written in place as a stream; never an input."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterator, Sequence

__all__ = ["OutputClashError", "check_not_an_input", "open_output", "save_figure", "writes_in_place", "writes_stdout"]

STDIO = "-"
# /proc/PID/fd and /proc/PID/task/TID/fd: what /dev/fd, /dev/stdout and /proc/self/fd resolve to.
_DESCRIPTOR_DIR = re.compile(r"/proc/(\d+)(?:/task/\d+)?/fd")
_MAX_LINKS = 40  # as the kernel's own limit on symlinks followed in one lookup


class OutputClashError(ValueError):
    """An output path names a file the same command reads, or a file inside a directory it reads."""


def writes_stdout(path: str) -> bool:
    """Whether ``path`` is this process's standard output (``-``, /dev/stdout, /dev/fd/1, ...).

    >>> writes_stdout("-"), writes_stdout("/dev/stdout"), writes_stdout("/proc/self/fd/1"), writes_stdout("out.jsonl")
    (True, True, True, False)
    """
    return path == STDIO or _descriptor_number(path) == 1


def writes_in_place(path: str) -> bool:
    """Whether `open_output` writes ``path`` as a stream (what was written before a failure stays
    there) rather than as a regular file that appears whole or not at all.

    >>> writes_in_place("-"), writes_in_place("/dev/null"), writes_in_place("/nonexistent/out.jsonl")
    (True, True, False)
    """
    if path == STDIO or _descriptor_number(path) is not None:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def check_not_an_input(output: str, inputs: Sequence[str | None] = (),
                       input_dirs: Sequence[str | None] = ()) -> None:
    """Raise `OutputClashError` when ``output`` is one of ``inputs`` or lies in one of ``input_dirs``.

    Same file means the same inode, whatever the spelling: ``X``, ``./X``, a symlink or a hard
    link to X, or a descriptor (/dev/stdout) the shell opened on X. ``-`` (stdin/stdout) and
    inputs that do not exist never clash; nor do outputs that are streams (a device, a FIFO).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> x = os.path.join(d, "t.jsonl"); open(x, "w").close()
    >>> check_not_an_input(os.path.join(d, ".", "t.jsonl"), [x])
    Traceback (most recent call last):
    ...
    specwatch.outputs.OutputClashError: the output ... is the input ...; write the output to another file
    >>> check_not_an_input(os.path.join(d, "new", "metadata.txt"), [], [d])
    Traceback (most recent call last):
    ...
    specwatch.outputs.OutputClashError: the output ... is inside ..., which this command reads; write the output elsewhere
    >>> check_not_an_input(os.path.join(d, "out.jsonl"), [x, None, "-"])
    """
    if output == STDIO:
        return
    number = _descriptor_number(output)
    try:
        found = os.fstat(number) if number is not None else os.stat(output)
    except OSError:  # does not exist (yet), or a closed descriptor: nothing of ours behind it
        found = None
    if found is not None and not (stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)):
        return  # a stream: written in place, it replaces nothing
    for source in inputs:
        if not source or source == STDIO:
            continue
        try:
            same = found is not None and os.path.samestat(found, os.stat(source))
        except OSError:  # the input does not exist: nothing to overwrite
            same = False
        if same:
            raise OutputClashError(f"the output {output} is the input {source}; write the output to another file")
    where = Path(os.path.realpath(f"/proc/self/fd/{number}" if number is not None else output))
    for directory in input_dirs:
        if not directory:
            continue
        inside = Path(os.path.realpath(directory))
        if where == inside or inside in where.parents:
            raise OutputClashError(f"the output {output} is inside {directory}, which this command reads; "
                                   "write the output elsewhere")


@contextlib.contextmanager
def open_output(path: str, *, inputs: Sequence[str | None] = (), input_dirs: Sequence[str | None] = (),
                binary: bool = False, encoding: str = "utf-8") -> Iterator[IO]:
    """A stream for ``path``: `OutputClashError` before anything is written if ``path`` is an input.

    A regular file (or a path that does not exist yet) is written beside itself and renamed over
    the file (a symlink's target, keeping its mode) only on success. Anything else is written in
    place and never replaced: ``-`` and /dev/stdout, a descriptor path (/dev/fd/N,
    /proc/self/fd/N: the very descriptor, so a shell's ``>>`` keeps appending and a pipe stays a
    pipe), a device, a FIFO. An `OSError` raised while writing names ``path``.
    """
    check_not_an_input(path, inputs, input_dirs)
    mode = "wb" if binary else "w"
    text = {} if binary else {"encoding": encoding}
    number = 1 if path == STDIO else _descriptor_number(path)
    with _naming(path):
        if number is not None:
            for stream in (sys.stdout, sys.stderr):  # what was printed before comes first
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            try:
                descriptor = os.dup(number)
            except OSError as error:
                raise OSError(error.errno, f"descriptor {number} is not open in this process", path) from None
            with open(descriptor, mode, **text) as stream:
                yield stream
            return
        descriptor = _open_stream(path)
        if descriptor is not None:
            with open(descriptor, mode, **text) as stream:
                yield stream
            return
        with _replacing(path, mode, text) as stream:
            yield stream


def _descriptor_number(path: str) -> int | None:
    """N when ``path`` leads, through any symlinks, to this process's /proc/PID/fd/N; else None."""
    current = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        parent, name = os.path.split(current)
        found = _DESCRIPTOR_DIR.fullmatch(os.path.realpath(parent))
        if found and int(found.group(1)) == os.getpid() and name.isdigit():
            return int(name)  # read no further: the link's text is a pipe:[...] or a path reopened
        try:
            link = os.readlink(current)
        except OSError:  # not a symlink (or not there)
            return None
        current = os.path.normpath(os.path.join(parent, link))
    return None


def _open_stream(path: str) -> int | None:
    """A descriptor on ``path`` when it exists and is not a regular file (a device, a FIFO, a
    socket's peer); None for a regular file or a path that is not there yet."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(found.st_mode):
        return None
    if stat.S_ISDIR(found.st_mode):
        raise IsADirectoryError(21, "Is a directory", path)
    # No O_TRUNC and no O_CREAT: a stream is written as it stands (a FIFO waits for its reader here).
    descriptor = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    if stat.S_ISREG(os.fstat(descriptor).st_mode):  # replaced by a regular file since the stat
        os.close(descriptor)
        return None
    return descriptor


@contextlib.contextmanager
def _replacing(path: str, mode: str, text: dict) -> Iterator[IO]:
    target = Path(os.path.realpath(path))
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:  # name the file asked for, not the temporary one
        raise OSError(error.errno, error.strerror, path) from None
    try:
        try:
            permissions = os.stat(target).st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            permissions = 0o666 & ~umask
        os.fchmod(fd, permissions)
        with open(fd, mode, **text) as stream:
            yield stream
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """A write error (ENOSPC, EPIPE, EIO) carries no file name: give it the output's."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = path
        raise


def save_figure(figure, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """A matplotlib ``figure`` as PNG through `open_output`: a regular file appears whole or not at
    all, a device, a pipe or a shell's descriptor is written in place and never replaced."""
    with open_output(os.fspath(path), binary=True) as stream:
        figure.savefig(stream, format="png", dpi=dpi)
