"""The one send path of the decisions topic: each decision and heartbeat as one signed message, for any producer.

Callers name no partition: kafka-python and aiokafka both place a key with Kafka's murmur2.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from specwatch.schemas import Decision

from .codec import decision_message, heartbeat_message
from .signing import Keyring, warn_unsigned

__all__ = ["DecisionSink"]

Sent = TypeVar("Sent")


class DecisionSink(Generic[Sent]):
    """Signs decisions and heartbeats and sends them to the decisions topic through ``send``.

    ``send(topic, value, key=..., headers=...)`` is a producer's; what it returns is what
    `decision` and `heartbeat` return. Without a key messages go out unsigned, after one
    warning naming ``role``.

    >>> sent = []
    >>> sink = DecisionSink(lambda topic, value, **kw: sent.append((topic, kw["key"], value)), "d", Keyring())
    >>> sink.decision(Decision(ts=1.0, bundle_id="b-1", bucket="coding", action="alert",
    ...                        reason="draft_overhead", detector="cost"))
    >>> sent[0][:2]
    ('d', b'b-1/coding/*')
    """

    def __init__(self, send: Callable[..., Sent], topic: str, keyring: Keyring, *,
                 role: str = "the decision publisher") -> None:
        self._send = send
        self.topic = topic
        self.keyring = keyring
        if not keyring.enabled:
            warn_unsigned(role)

    def decision(self, decision: Decision) -> Sent:
        key, value, headers = decision_message(decision, self.keyring)
        return self._send(self.topic, value, key=key, headers=headers)

    def heartbeat(self, publisher_id: str, seq: int, watermark: float | None) -> Sent:
        key, value, headers = heartbeat_message(publisher_id, seq, watermark, keyring=self.keyring)
        return self._send(self.topic, value, key=key, headers=headers)
