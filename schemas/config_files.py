"""Reading the small files an operator names (key files, policy files, model configs): regular
files only, and never more than a bound, so /dev/zero or a FIFO gives a clear error, not a hang."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_config_file"]

_FILE_TYPES = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def read_config_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``; OSError (with a reason a person can act on) for
    anything else or for a file longer than ``max_bytes``.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(delete=False) as f: _ = f.write(b"x = 1")
    >>> read_config_file(f.name, 16)
    b'x = 1'
    >>> read_config_file(f.name, 4)
    Traceback (most recent call last):
    ...
    OSError: [Errno 27] larger than 4 bytes: not a config or key file: '...'
    >>> read_config_file("/dev/zero", 4)
    Traceback (most recent call last):
    ...
    OSError: [Errno 22] a character device, not a regular file: '/dev/zero'
    """
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before the check below.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        kind = stat.S_IFMT(os.fstat(descriptor).st_mode)
        if kind != stat.S_IFREG:
            raise OSError(errno.EINVAL, f"{_FILE_TYPES.get(kind, 'not a file')}, not a regular file", os.fspath(path))
        os.set_blocking(descriptor, True)
        with open(descriptor, "rb", closefd=False) as stream:
            data = stream.read(max_bytes + 1)
    finally:
        os.close(descriptor)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes: not a config or key file", os.fspath(path))
    return data
