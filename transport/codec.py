"""Messages of the decisions topic: signed decisions and heartbeats, encoded, sent through any
producer and decoded in one place (docs/SECURITY.md)."""

from __future__ import annotations

import math
import time
from typing import Callable, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specwatch.schemas import Decision

from .signing import Keyring, sign_line, warn_unsigned

__all__ = ["HEARTBEAT_KEY_PREFIX", "DecisionSink", "Heartbeat", "Message", "decode_decision",
           "decode_heartbeat", "heartbeat_message", "is_heartbeat_key"]

HEARTBEAT_KEY_PREFIX = "__heartbeat__/"
MAX_PUBLISHER_ID_CHARS = 200

Message = tuple[bytes, bytes, list[tuple[str, bytes]]]
"""Key, value and headers, ready for any Kafka producer."""


def _signed(item: Decision | Heartbeat, keyring: Keyring) -> Message:
    """Key (a decision's scope, a heartbeat's ``__heartbeat__/<publisher>``), value and the
    signature headers over the exact value (`transport.signing`)."""
    value = item.to_json_line().encode("utf-8")
    return item.key.encode("utf-8"), value, sign_line(value, keyring)


def _decoded(model: type[Decision] | type[Heartbeat], value: bytes | str | None):
    if value is None:
        return None
    try:
        return model.model_validate_json(value)
    except (ValidationError, ValueError):
        return None


def decode_decision(value: bytes | str | None) -> Decision | None:
    """A decision from a message value; None for a tombstone or anything that is not one.

    >>> line = Decision(ts=1.0, bundle_id="b-1", action="alert", reason="draft_overhead",
    ...                 detector="cost").to_json_line()
    >>> decode_decision(line.encode()).action, decode_decision(b"{oops"), decode_decision(None)
    ('alert', None, None)
    """
    return _decoded(Decision, value)


class Heartbeat(BaseModel):
    """A publisher's sign of life on the decisions topic, signed like a decision. ``wall_time`` is
    the publisher's clock when it sent it (clients judge silence by it); ``watermark`` the event
    time the publisher's pipeline has reached (lag = wall - watermark)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Literal["heartbeat"] = "heartbeat"
    v: Literal[1] = 1
    publisher: str = Field(min_length=1, max_length=MAX_PUBLISHER_ID_CHARS)
    seq: int = Field(ge=0)
    wall_time: float = Field(ge=0, allow_inf_nan=False)
    watermark: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def to_json_line(self) -> str:
        return self.model_dump_json()

    @property
    def key(self) -> str:
        return HEARTBEAT_KEY_PREFIX + self.publisher


def decode_heartbeat(value: bytes | str | None) -> Heartbeat | None:
    """A heartbeat from a message value; None for anything that is not one.

    >>> key, value, headers = heartbeat_message("stage2-0", 3, 1700.5, keyring=Keyring(), wall_time=1800.0)
    >>> key, decode_heartbeat(value).watermark, headers
    (b'__heartbeat__/stage2-0', 1700.5, [])
    """
    return _decoded(Heartbeat, value)


def heartbeat_message(publisher_id: str, seq: int, watermark: float | None, *, keyring: Keyring,
                      wall_time: float | None = None) -> Message:
    """Key, value and signature headers of one heartbeat, ready for any Kafka producer. One
    compacted key per ``publisher_id``; ``watermark`` is the event time its pipeline reached (None
    before any), ``wall_time`` the send time (now by default)."""
    if watermark is not None and not math.isfinite(watermark):
        watermark = None
    beat = Heartbeat(publisher=publisher_id, seq=seq, watermark=watermark,
                     wall_time=time.time() if wall_time is None else wall_time)
    return _signed(beat, keyring)


def is_heartbeat_key(key: bytes | None) -> bool:
    return key is not None and key.startswith(HEARTBEAT_KEY_PREFIX.encode())


Sent = TypeVar("Sent")


class DecisionSink(Generic[Sent]):
    """The one send path of the decisions topic: signs decisions and heartbeats and sends each as
    one message through ``send(topic, value, key=..., headers=...)``, a producer's, whose result
    it returns. No partition is named: kafka-python and aiokafka both place a key with murmur2.
    Without a key messages go out unsigned, after one warning naming ``role``.

    >>> sent = []
    >>> sink = DecisionSink(lambda topic, value, **kw: sent.append((topic, kw, value)), "d",
    ...                     Keyring())
    >>> decision = Decision(ts=1.0, bundle_id="b-1", bucket="coding", action="alert",
    ...                     reason="draft_overhead", detector="cost")
    >>> sink.decision(decision)
    >>> (topic, sent_with, value), = sent
    >>> topic, sent_with, decode_decision(value) == decision
    ('d', {'key': b'b-1/coding/*', 'headers': []}, True)
    """

    def __init__(self, send: Callable[..., Sent], topic: str, keyring: Keyring, *,
                 role: str = "the decision publisher") -> None:
        self._send = send
        self.topic = topic
        self.keyring = keyring
        if not keyring.enabled:
            warn_unsigned(role)

    def decision(self, decision: Decision) -> Sent:
        key, value, headers = _signed(decision, self.keyring)
        return self._send(self.topic, value, key=key, headers=headers)

    def heartbeat(self, publisher_id: str, seq: int, watermark: float | None) -> Sent:
        key, value, headers = heartbeat_message(publisher_id, seq, watermark, keyring=self.keyring)
        return self._send(self.topic, value, key=key, headers=headers)
