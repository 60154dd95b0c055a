"""The stage-task checkpoint format: a versioned MessagePack document of plain data, and its signature.

Decoding yields numbers, strings, bytes, lists and maps only; nothing in it names code to run.
"""

from __future__ import annotations

from typing import Any, Literal

import zlib

import msgspec

__all__ = ["CHECKPOINT_MAGIC", "CHECKPOINT_VERSION", "PICKLED_CHECKPOINT_MAGIC", "Checkpoint", "CheckpointError",
           "inflated", "pack_checkpoint", "unpack_checkpoint", "read_payload"]

CHECKPOINT_MAGIC = b"SWCK"
# What checkpoints before this format began with: a pickle, compressed (see streams/pickled_checkpoints.py).
PICKLED_CHECKPOINT_MAGIC = b"SWCP1"
CHECKPOINT_VERSION = 1
"""The format version this code writes and the only one it reads; a new one keeps reading this one
(tests/golden/ holds a checkpoint of every version)."""


class CheckpointError(ValueError):
    """A checkpoint that is not used, and why: ``reason`` is one of ``not_a_checkpoint``,
    ``undecodable``, ``unsupported_version``, ``unsigned``, ``forged``, ``unknown_key``,
    ``wrong_task`` or ``pickled_refused``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Checkpoint(msgspec.Struct, forbid_unknown_fields=True):
    """One task's state. ``state`` is what the task's ``to_state()`` gives: maps, lists and scalars,
    read back by its ``from_state()``. ``policy`` is the policy the state was shaped by."""

    version: int
    kind: Literal["stage1", "stage2"]
    name: str  # the task it was saved for ("" when saved outside a checkpoint log)
    policy: dict[str, Any]
    state: dict[str, Any]


# A stage-2 checkpoint of a busy partition is tens of MB unpacked; a larger one is refused while
# it is inflated, not after it filled the memory.
_MAX_UNPACKED_BYTES = 1 << 30


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    payload: bytes  # a `Checkpoint`, encoded and compressed: the bytes the signature covers
    signature: str = ""  # the signature header's value (transport/signing.py), "" when unsigned


class _Version(msgspec.Struct):
    version: int


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_version_decoder = msgspec.msgpack.Decoder(_Version)
_checkpoint_decoder = msgspec.msgpack.Decoder(Checkpoint)
_encoder = msgspec.msgpack.Encoder()


def pack_checkpoint(checkpoint: Checkpoint, sign=lambda payload: "") -> bytes:
    """``checkpoint`` as bytes, with ``sign(payload)`` as its signature.

    >>> data = pack_checkpoint(Checkpoint(CHECKPOINT_VERSION, "stage1", "s1/t/0", {}, {"next_offset": 4}))
    >>> payload, signature = unpack_checkpoint(data)
    >>> read_payload(payload).state, signature
    ({'next_offset': 4}, '')
    """
    payload = zlib.compress(_encoder.encode(checkpoint), 1)
    return CHECKPOINT_MAGIC + _encoder.encode(_Envelope(payload, sign(payload)))


def unpack_checkpoint(data: bytes) -> tuple[bytes, str]:
    """The payload and signature of a checkpoint, nothing decoded yet but the envelope."""
    if not bytes(data[:len(CHECKPOINT_MAGIC)]) == CHECKPOINT_MAGIC:
        raise CheckpointError("not_a_checkpoint", "bad header: not a specwatch checkpoint of this format")
    try:
        envelope = _envelope_decoder.decode(data[len(CHECKPOINT_MAGIC):])
    except msgspec.DecodeError as error:
        raise CheckpointError("undecodable", f"the envelope does not decode: {error}") from error
    return envelope.payload, envelope.signature


def inflated(data: bytes) -> bytes:
    """Compressed checkpoint bytes unpacked, refused past `_MAX_UNPACKED_BYTES` while inflating."""
    inflate = zlib.decompressobj()
    try:
        out = inflate.decompress(data, _MAX_UNPACKED_BYTES)
    except zlib.error as error:
        raise CheckpointError("undecodable", f"the payload does not inflate: {error}") from error
    if inflate.unconsumed_tail:
        raise CheckpointError("undecodable", f"the payload is larger than {_MAX_UNPACKED_BYTES} bytes unpacked")
    return out


def read_payload(payload: bytes) -> Checkpoint:
    """A checkpoint's payload (its signature already checked), its version first.

    >>> read_payload(zlib.compress(msgspec.msgpack.encode({"version": 9, "kind": "stage2"})))
    Traceback (most recent call last):
    ...
    specwatch.schemas.checkpoint.CheckpointError: unsupported_version: checkpoint format version 9 is not one this version reads (it reads 1); the task rebuilds from its source topic
    """
    payload = inflated(payload)
    try:
        version = _version_decoder.decode(payload).version
    except msgspec.DecodeError as error:
        raise CheckpointError("undecodable", f"no format version: {error}") from error
    if version != CHECKPOINT_VERSION:
        raise CheckpointError("unsupported_version", f"checkpoint format version {version} is not one this version "
                                                     f"reads (it reads {CHECKPOINT_VERSION}); the task rebuilds "
                                                     "from its source topic")
    try:
        return _checkpoint_decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise CheckpointError("undecodable", f"the checkpoint does not decode: {error}") from error
