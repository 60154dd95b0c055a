"""Signatures on the decisions topic: HMAC-SHA256 over the exact message value, in a Kafka header.

Pure: publishers call `sign_line`, readers `verify`. Header and rotation: docs/SECURITY.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from specwatch.schemas.keys import key_id, read_key_file

__all__ = ["SIGNATURE_HEADER", "SIGNING_KEY_ENV", "SIGNING_KEY_FILE_ENV",
           "PREVIOUS_SIGNING_KEY_ENV", "PREVIOUS_SIGNING_KEY_FILE_ENV", "SigningKey", "Keyring",
           "Verdict", "sign_line", "verify", "warn_unsigned"]

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "specwatch-signature"
SIGNING_KEY_ENV = "SPECWATCH_SIGNING_KEY"
SIGNING_KEY_FILE_ENV = "SPECWATCH_SIGNING_KEY_FILE"
PREVIOUS_SIGNING_KEY_ENV = "SPECWATCH_SIGNING_PREVIOUS_KEY"
PREVIOUS_SIGNING_KEY_FILE_ENV = "SPECWATCH_SIGNING_PREVIOUS_KEY_FILE"

_VERSION = "v1"
_HEX_DIGEST_CHARS = 64
# A header longer than any valid one is refused before it is parsed.
_MAX_HEADER_BYTES = 128


class Verdict(enum.Enum):
    """What `verify` found. Only `VALID` and `UNCHECKED` may be acted on."""

    VALID = "valid"
    UNCHECKED = "unchecked"  # no key configured: nothing can be checked (insecure mode)
    UNSIGNED = "unsigned"
    FORGED = "forged"  # a signature that does not match, or that is malformed
    UNKNOWN_KEY = "unknown_key"  # signed with a key this reader does not hold

    @property
    def accepted(self) -> bool:
        return self in (Verdict.VALID, Verdict.UNCHECKED)


@dataclass(frozen=True)
class SigningKey:
    """One HMAC key. ``key_id`` names it in headers; the secret never appears in a repr."""

    key_id: str
    secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes | str) -> "SigningKey":
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        return cls(key_id(secret, b"specwatch-key-id\x00", "signing"), secret)


@dataclass(frozen=True)
class Keyring:
    """The key publishers sign with (``current``) and the keys readers accept (and ``previous``).

    An empty keyring (no key configured) signs nothing and accepts everything: `Verdict.UNCHECKED`.

    >>> ring = Keyring.from_env({"SPECWATCH_SIGNING_KEY": "correct horse battery staple"})
    >>> ring.enabled, [k.key_id for k in ring.keys()] == [ring.current.key_id]
    (True, True)
    """

    current: SigningKey | None = None
    previous: SigningKey | None = None

    def __post_init__(self) -> None:
        if self.previous is not None and self.current is None:
            raise ValueError("a previous signing key needs a current one")

    @property
    def enabled(self) -> bool:
        return self.current is not None

    def keys(self) -> list[SigningKey]:
        return [k for k in (self.current, self.previous) if k is not None]

    def find(self, key_id: str) -> SigningKey | None:
        return next((key for key in self.keys() if hmac.compare_digest(key.key_id, key_id)), None)

    @classmethod
    def from_secrets(cls, current: bytes | str | None, previous: bytes | str | None = None) -> "Keyring":
        return cls(SigningKey.from_secret(current) if current is not None else None,
                   SigningKey.from_secret(previous) if previous is not None else None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Keyring":
        """Keys from ``SPECWATCH_SIGNING_KEY_FILE`` or ``SPECWATCH_SIGNING_KEY`` (and the previous).

        ValueError, never naming the key, when a setting is empty, ambiguous, unreadable or weak.
        """
        environ = os.environ if environ is None else environ
        current = _secret_from(environ, SIGNING_KEY_FILE_ENV, SIGNING_KEY_ENV)
        previous = _secret_from(environ, PREVIOUS_SIGNING_KEY_FILE_ENV, PREVIOUS_SIGNING_KEY_ENV)
        return cls.from_secrets(current, previous)


def _secret_from(environ: Mapping[str, str], file_var: str, value_var: str) -> bytes | None:
    path, value = environ.get(file_var), environ.get(value_var)
    for name, setting in ((file_var, path), (value_var, value)):
        # An empty setting is a key that did not arrive (a missing secret, a typo in a
        # unit file); reading it as "no key" would silently switch signing off.
        if setting is not None and not setting.strip():
            raise ValueError(f"{name} is set but empty: give it the key{' file' if name == file_var else ''}, "
                             "or unset it to run without signing")
    if path and value:
        raise ValueError(f"set either {file_var} or {value_var}, not both")
    if value:
        return value.encode("utf-8")
    if not path:
        return None
    secret = read_key_file(path, file_var, "signing").rstrip(b"\r\n")
    if not secret:
        raise ValueError(f"the signing key file named by {file_var} ({path}) is empty")
    return secret


def _mac(secret: bytes, line: bytes) -> str:
    return hmac.new(secret, line, hashlib.sha256).hexdigest()


def sign_line(line: bytes, keyring: Keyring) -> list[tuple[str, bytes]]:
    """Kafka headers that sign ``line`` (the exact message value) with the current key; [] without.

    >>> ring = Keyring.from_secrets(b"0123456789abcdef0123456789abcdef")
    >>> headers = sign_line(b'{"kind":"decision"}', ring)
    >>> headers[0][0], headers[0][1][:17]
    ('specwatch-signature', b'v1:k-ef5df5080828')
    >>> verify(b'{"kind":"decision"}', headers, ring), verify(b'{"kind":"decision"} ', headers, ring)
    (<Verdict.VALID: 'valid'>, <Verdict.FORGED: 'forged'>)
    """
    key = keyring.current
    if key is None:
        return []
    value = f"{_VERSION}:{key.key_id}:{_mac(key.secret, bytes(line))}"
    return [(SIGNATURE_HEADER, value.encode("ascii"))]


def verify(line: bytes | None, headers: Iterable[tuple[str, bytes | None]] | Mapping[str, bytes] | None,
           keyring: Keyring) -> Verdict:
    """Whether ``line`` is validly signed by a key of ``keyring``; malformed headers are `FORGED`.
    ``headers`` as kafka-python, aiokafka or Faust give them."""
    if not keyring.enabled:
        return Verdict.UNCHECKED
    if line is None:
        return Verdict.UNSIGNED
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    found = None
    try:
        for name, value in pairs:
            if name != SIGNATURE_HEADER:
                continue
            verdict = _check(bytes(line), value, keyring)
            if verdict is Verdict.VALID:
                return verdict
            found = verdict if found is None or found is Verdict.UNKNOWN_KEY else found
    except (TypeError, ValueError):  # headers that are not (name, bytes) pairs
        return Verdict.FORGED
    return found or Verdict.UNSIGNED


def _check(line: bytes, header: bytes | None, keyring: Keyring) -> Verdict:
    if not isinstance(header, (bytes, bytearray)) or len(header) > _MAX_HEADER_BYTES:
        return Verdict.FORGED
    try:
        version, key_id, digest = bytes(header).decode("ascii").split(":")
    except (UnicodeDecodeError, ValueError):
        return Verdict.FORGED
    if version != _VERSION or len(digest) != _HEX_DIGEST_CHARS:
        return Verdict.FORGED
    key = keyring.find(key_id)
    if key is None:
        return Verdict.UNKNOWN_KEY
    # Constant time: the comparison must not tell a forger how many characters were right.
    if hmac.compare_digest(_mac(key.secret, line), digest):
        return Verdict.VALID
    return Verdict.FORGED


def warn_unsigned(role: str) -> None:
    """Say, once per publisher or client, that messages on the decisions topic go unchecked."""
    logger.warning("%s runs WITHOUT a signing key: anyone who can write the decisions topic can switch "
                   "speculation off or on. Set SPECWATCH_SIGNING_KEY_FILE (or SPECWATCH_SIGNING_KEY) on "
                   "publishers and flag clients alike.", role)
