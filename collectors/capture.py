"""Sealed capture on the engine side: which finished requests keep their token ids, sealed."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specwatch.schemas.policy import CapturePolicy
from specwatch.schemas.sealed import SAMPLE_KEY_FILE_ENV, SampleKey, Sealer

__all__ = ["CaptureStats", "SampleCapture", "captured"]

_UNIT = float(1 << 64)


def captured(request_id: str, rate: float) -> bool:
    """Whether a request id falls in the captured share: a digest, so every run picks the same.

    >>> captured("r-1", 1.0), captured("r-1", 0.0)
    (True, False)
    >>> sum(captured(f"r-{i}", 0.01) for i in range(10_000))
    114
    """
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / _UNIT < rate


@dataclass(frozen=True)
class CaptureStats:
    """What a capture did: requests sealed, the ones chosen but too long to keep, CPU time in `seal` calls."""

    sealed: int
    too_long: int
    capture_s: float


class SampleCapture:
    """The policy's ``[capture]`` rule with the key that seals what it captures (needed if enabled).

    >>> key = SampleKey.from_secret(b"0123456789abcdef0123456789abcdef")
    >>> capture = SampleCapture(CapturePolicy(enabled=True, rate=1.0, buckets=["coding"]), key)
    >>> capture.seal("r-1", "chat", [1], [2]) is None, capture.seal("r-1", "coding", [1], [2])[:4]
    (True, 'sw2.')
    """

    def __init__(self, policy: CapturePolicy, key: SampleKey | None) -> None:
        if not isinstance(policy, CapturePolicy):
            raise TypeError(f"policy must be a CapturePolicy, not {type(policy).__name__}")
        if policy.enabled and key is None:
            raise ValueError(f"capture is enabled but there is no sample key: set {SAMPLE_KEY_FILE_ENV} "
                             "to a file holding at least 16 random bytes")
        self.policy = policy
        self.key_id = key.key_id if key is not None else None
        self._sealer = Sealer(key) if policy.enabled else None
        self._buckets = frozenset(policy.buckets)
        self._sealed = 0
        self._too_long = 0
        self._capture_ns = 0

    @classmethod
    def from_policy(cls, policy: CapturePolicy,
                    environ: Mapping[str, str] | None = None) -> "SampleCapture | None":
        """The capture a policy asks for, with the key from the environment; None when off."""
        if not policy.enabled:
            return None
        return cls(policy, SampleKey.from_env(environ))

    def wants(self, request_id: str, bucket: str, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether the policy takes this request (a chosen one that is too long is counted)."""
        if self._sealer is None:
            return False
        if (self._buckets and bucket not in self._buckets) or not captured(request_id, self.policy.rate):
            return False
        if prompt_tokens > self.policy.max_prompt_tokens or output_tokens > self.policy.max_output_tokens:
            self._too_long += 1
            return False
        return True

    def seal(self, request_id: str, bucket: str, prompt_ids: Sequence[int] | None,
             output_ids: Sequence[int] | None, sample_id: str | None = None) -> str | None:
        """The sealed token ids of a finished request, or None when the policy does not take it;
        bound to ``sample_id``, the id its record carries (default: ``request_id``)."""
        # CPU time of this thread: the emitter thread waits for the GIL while engine steps run,
        # and wall time would count those waits as the capture's cost
        start = time.thread_time_ns()
        sealed = None
        if prompt_ids is not None and output_ids is not None and self.wants(request_id, bucket, len(prompt_ids),
                                                                            len(output_ids)):
            sealed = self._sealer.seal(prompt_ids, output_ids, sample_id=sample_id or request_id)
            self._sealed += 1
        self._capture_ns += time.thread_time_ns() - start
        return sealed

    def stats(self) -> CaptureStats:
        return CaptureStats(self._sealed, self._too_long, self._capture_ns / 1e9)
