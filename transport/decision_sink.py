"""The one send path of the decisions topic: each decision and heartbeat as one signed message, for any producer.

`DecisionSink` turns a decision (or a heartbeat) into its message (key = scope, value =
the contract line, signature headers: `transport.codec`) and hands it to the producer's
``send``. The command-line publisher passes a kafka-python ``KafkaProducer.send`` (a
future back), the stream workers `KafkaWriter.send` (aiokafka: a coroutine that yields the
acknowledgement future). Neither names a partition: both clients place a key with the
same murmur2 partitioner as Kafka's Java clients, so a scope lands on one partition
whoever publishes it.
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

    Parameters
    ----------
    send
        ``send(topic, value, key=..., headers=...)`` of a producer; what it returns (a
        kafka-python future, an aiokafka coroutine) is what `decision` and `heartbeat` return.
    topic
        The decisions topic.
    keyring
        Signs every message; without a key messages go out unsigned, with one warning.
    role
        Names the publisher in that warning.

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
