"""Secret keys, for signed decisions and sealed samples alike: checked, read from a key
file, and named by a digest that gives nothing away."""

from __future__ import annotations

import hashlib
import logging
import os

from .config_files import read_config_file

__all__ = ["key_id", "read_key_file"]

logger = logging.getLogger(__name__)

# 128 bits: below that a key can be guessed offline from what it signs or seals.
_MIN_KEY_BYTES = 16
_MAX_KEY_BYTES = 4096
_KEY_ID_CHARS = 12


def key_id(secret: bytes, salt: bytes, what: str) -> str:
    """The id naming ``secret``; ValueError, never showing it, if it is too short or too long."""
    if not _MIN_KEY_BYTES <= len(secret) <= _MAX_KEY_BYTES:
        raise ValueError(f"a {what} key must be {_MIN_KEY_BYTES} to {_MAX_KEY_BYTES} bytes long, "
                         f"got {len(secret)}: generate one with `head -c 32 /dev/urandom | base64`")
    return "k-" + hashlib.sha256(salt + secret).hexdigest()[:_KEY_ID_CHARS]


def read_key_file(path: str, variable: str, what: str) -> bytes:
    """The bytes of the key file ``variable`` names; a warning if other users can read it."""
    try:
        mode = os.stat(path).st_mode
        # room for a trailing newline or base64 of the longest key; /dev/zero or a FIFO is refused
        secret = read_config_file(path, 2 * _MAX_KEY_BYTES)
    except OSError as error:
        raise ValueError(f"{variable}={path}: cannot read the {what} key file: "
                         f"{error.strerror or error}") from None
    if mode & 0o077:
        logger.warning("the %s key file %s can be read by other users (mode %o); chmod 600 it",
                       what, path, mode & 0o777)
    return secret
