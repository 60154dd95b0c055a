"""Sealed samples: a request's prompt and output token ids under envelope encryption."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from . import keys

__all__ = ["SAMPLE_KEY_ENV", "SAMPLE_KEY_FILE_ENV", "SealedSampleError", "SampleKey",
           "OpenedSample", "Sealer", "sealed_key_id", "open_sealed", "token_digest"]

SAMPLE_KEY_ENV = "SPECWATCH_SAMPLE_KEY"
SAMPLE_KEY_FILE_ENV = "SPECWATCH_SAMPLE_KEY_FILE"

# sw2 binds each ciphertext to its sample (request) id through the AES-GCM associated data, so a
# ciphertext copied onto another sample's row does not open; sw1 (no binding) still opens.
_VERSION = "sw2"
_UNBOUND_VERSION = "sw1"
# A sample id in the associated data is at most this long (the contract's id limit is shorter).
_MAX_SAMPLE_ID_CHARS = 1024
_NONCE_BYTES = 12
_DATA_KEY_BYTES = 32
# Samples sealed under one data key before a new one is drawn: a batch of the collector's
# captures. One wrap per batch keeps sealing cheap; a leaked data key opens one batch only.
_DEFAULT_BATCH_SAMPLES = 256
# A sealed sample is at most this long (the contract's line limit bounds it further).
_MAX_SEALED_CHARS = 1 << 20
_KEK_INFO = b"specwatch sample key-encryption key v1"
_KEY_ID_SALT = b"specwatch sample key id v1\0"
_SEALED_RE = re.compile(r"(sw[12])\.(k-[0-9a-f]{12})\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")


class SealedSampleError(ValueError):
    """A sealed sample cannot be opened; the message says why (never with key material)."""


@dataclass(frozen=True)
class SampleKey:
    """The key-encryption key for sealed samples. Neither secret nor derived key shows in a repr."""

    key_id: str
    kek: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> "SampleKey":
        if not isinstance(secret, bytes):
            raise TypeError("a sample key secret must be bytes")
        key_id = keys.key_id(secret, _KEY_ID_SALT, "sample")
        kek = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KEK_INFO).derive(secret)
        return cls(key_id, kek)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SampleKey | None":
        """The key in ``$SPECWATCH_SAMPLE_KEY_FILE`` (preferred) or ``$SPECWATCH_SAMPLE_KEY``."""
        environ = os.environ if environ is None else environ
        for name in (SAMPLE_KEY_FILE_ENV, SAMPLE_KEY_ENV):
            # An empty setting is a key that did not arrive (a missing secret, a typo in a unit
            # file), as for the signing key: never read as "no key".
            if name in environ and not environ[name].strip():
                raise ValueError(f"{name} is set but empty: give it the key{' file' if name == SAMPLE_KEY_FILE_ENV else ''}, "
                                 "or unset it")
        path = environ.get(SAMPLE_KEY_FILE_ENV, "").strip()
        if path:
            secret = keys.read_key_file(path, SAMPLE_KEY_FILE_ENV, "sample").strip()
            source = f"{SAMPLE_KEY_FILE_ENV}={path}"
        elif environ.get(SAMPLE_KEY_ENV, "").strip():
            secret = environ[SAMPLE_KEY_ENV].strip().encode()
            source = SAMPLE_KEY_ENV
        else:
            return None
        try:
            return cls.from_secret(secret)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None


@dataclass(frozen=True)
class OpenedSample:
    """The clear token ids of one sealed sample, checked against the record's digests;
    ``bound`` when its ciphertext was bound to its sample id (sw2), False for older sw1 samples."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    bound: bool = True


def token_digest(token_ids: Sequence[int] | None) -> str | None:
    """sha256 of token ids packed as little-endian uint32: the contract's prompt/output digest.

    >>> token_digest([1, 2, 3]) == hashlib.sha256(bytes([1,0,0,0, 2,0,0,0, 3,0,0,0])).hexdigest()
    True
    """
    if token_ids is None:
        return None
    return hashlib.sha256(_pack(token_ids)).hexdigest()


class Sealer:
    """Seals samples under one key-encryption key, drawing a new data key every batch.

    >>> key = SampleKey.from_secret(b"0123456789abcdef0123456789abcdef")
    >>> sealed = Sealer(key).seal([5, 6, 7], [8, 9], sample_id="r-1")
    >>> sealed.startswith("sw2.k-dba05dc9fc20."), sealed_key_id(sealed)
    (True, 'k-dba05dc9fc20')
    >>> opened = open_sealed(sealed, key, token_digest([5, 6, 7]), token_digest([8, 9]), sample_id="r-1")
    >>> opened.prompt_ids, opened.output_ids
    ((5, 6, 7), (8, 9))
    >>> open_sealed(sealed, key, None, None, sample_id="r-2")
    Traceback (most recent call last):
    ...
    specwatch.schemas.sealed.SealedSampleError: the sealed sample does not open as sample 'r-2' with key k-dba05dc9fc20: it belongs to another sample, was altered, or its key id was forged
    """

    def __init__(self, key: SampleKey, *, batch_samples: int = _DEFAULT_BATCH_SAMPLES,
                 random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        if not isinstance(key, SampleKey):
            raise TypeError(f"key must be a SampleKey, not {type(key).__name__}")
        if batch_samples < 1:
            raise ValueError(f"batch_samples must be >= 1, got {batch_samples}")
        self.key_id = key.key_id
        self._kek = key.kek
        self._batch_samples = batch_samples
        self._random = random_bytes
        self._left = 0
        self._cipher: AESGCM | None = None
        self._wrapped = ""

    def seal(self, prompt_ids: Sequence[int], output_ids: Sequence[int], *, sample_id: str) -> str:
        """The sealed form of one request's prompt and output token ids, bound to ``sample_id``
        (the request's id, as its record and its archive row name it)."""
        if self._left == 0:
            data_key = self._random(_DATA_KEY_BYTES)
            self._cipher = AESGCM(data_key)
            self._wrapped = _b64(aes_key_wrap(self._kek, data_key))
            self._left = self._batch_samples
        self._left -= 1
        nonce = self._random(_NONCE_BYTES)
        clear = struct.pack("<I", len(prompt_ids)) + _pack(prompt_ids) + _pack(output_ids)
        body = self._cipher.encrypt(nonce, clear, _aad(_VERSION, self.key_id, sample_id))
        return f"{_VERSION}.{self.key_id}.{self._wrapped}.{_b64(nonce + body)}"


def sealed_key_id(sealed: str) -> str:
    """The id of the key a sealed sample was sealed with; SealedSampleError if malformed."""
    return _parse(sealed)[1]


def open_sealed(sealed: str, key: SampleKey | None, prompt_sha256: str | None,
                output_sha256: str | None, sample_id: str | None = None) -> OpenedSample:
    """Open a sealed sample as ``sample_id`` and check its token ids against the record's digests.

    An sw2 sample opens only as the sample it was sealed for; an sw1 sample (sealed before
    samples were bound) opens as any, with ``bound`` False, its digests still checked."""
    version, key_id, wrapped, body = _parse(sealed)
    if key is None:
        raise SealedSampleError(f"no sample key: set {SAMPLE_KEY_FILE_ENV} (or {SAMPLE_KEY_ENV}) to the "
                                f"key {key_id} the samples were sealed with")
    if key.key_id != key_id:
        raise SealedSampleError(f"the sample was sealed with key {key_id} and the key given is {key.key_id}; "
                                f"set {SAMPLE_KEY_FILE_ENV} to the file of key {key_id}")
    bound = version != _UNBOUND_VERSION
    if bound and sample_id is None:
        raise SealedSampleError("a bound (sw2) sealed sample opens only with the id of its sample")
    try:
        data_key = aes_key_unwrap(key.kek, wrapped)
        clear = AESGCM(data_key).decrypt(body[:_NONCE_BYTES], body[_NONCE_BYTES:],
                                         _aad(version, key_id, sample_id if bound else None))
    except (InvalidUnwrap, InvalidTag, ValueError):
        if bound:
            raise SealedSampleError(f"the sealed sample does not open as sample {sample_id!r} with key {key_id}: "
                                    "it belongs to another sample, was altered, or its key id was forged") from None
        raise SealedSampleError(f"the sealed sample does not open with key {key_id}: it was altered "
                                "or its key id was forged") from None
    if len(clear) < 4 or (len(clear) - 4) % 4:
        raise SealedSampleError("the sealed sample opened but holds no token ids (malformed plaintext)")
    (n_prompt,) = struct.unpack_from("<I", clear)
    ids = struct.unpack_from(f"<{(len(clear) - 4) // 4}I", clear, 4)
    if n_prompt > len(ids):
        raise SealedSampleError("the sealed sample opened but its prompt length exceeds its token ids")
    opened = OpenedSample(tuple(ids[:n_prompt]), tuple(ids[n_prompt:]), bound)
    for name, expected, token_ids in (("prompt", prompt_sha256, opened.prompt_ids),
                                      ("output", output_sha256, opened.output_ids)):
        if expected is not None and token_digest(token_ids) != expected:
            raise SealedSampleError(f"the sealed sample's {name} token ids do not match the record's "
                                    f"{name}_sha256: the sample belongs to another request")
    return opened


def _parse(sealed: str) -> tuple[str, str, bytes, bytes]:
    if not isinstance(sealed, str) or len(sealed) > _MAX_SEALED_CHARS:
        raise SealedSampleError("a sealed sample must be a string of at most 1 MiB")
    found = _SEALED_RE.fullmatch(sealed)
    if found is None:
        raise SealedSampleError("not a sealed sample (expected sw2.<key id>.<wrapped key>.<ciphertext>)")
    try:
        wrapped, body = _unb64(found.group(3)), _unb64(found.group(4))
    except ValueError:
        raise SealedSampleError("a sealed sample's key or ciphertext is not base64url") from None
    if len(body) <= _NONCE_BYTES:
        raise SealedSampleError("a sealed sample's ciphertext is too short")
    return found.group(1), found.group(2), wrapped, body


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _aad(version: str, key_id: str, sample_id: str | None) -> bytes:
    # Binds the ciphertext to its format version and key id, and (sw2) to its sample id: none of
    # them can be edited, nor the ciphertext moved to another sample's row, unnoticed.
    if sample_id is None:
        return f"{version}.{key_id}".encode()
    if not isinstance(sample_id, str) or not 0 < len(sample_id) <= _MAX_SAMPLE_ID_CHARS:
        raise SealedSampleError(f"a sample id must be a string of 1 to {_MAX_SAMPLE_ID_CHARS} characters")
    return f"{version}.{key_id}\0{sample_id}".encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
