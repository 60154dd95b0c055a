"""The engine side of the decisions topic: follow it into local flag state, never blocking a lookup.

Heartbeats tell a quiet fleet from a monitor that is gone; then a configured fail-safe applies.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from specwatch.actions.flags import FlagStore, SpeculationState
from specwatch.schemas import Decision
from specwatch.transport.codec import Heartbeat, decode_heartbeat
from specwatch.transport.config import KafkaConfig
from specwatch.transport.decisions import DecisionReader
from specwatch.transport.signing import Keyring, Verdict, verify, warn_unsigned
from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["FAIL_SAFES", "SILENT_FALLBACK", "FlagClient", "FlagClientStats"]

logger = logging.getLogger(__name__)

_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_POLL_TIMEOUT_MS = 200
_DEFAULT_RETRY_BACKOFF_S = 1.0
_DEFAULT_MAX_RETRY_BACKOFF_S = 15.0
_DEFAULT_STOP_TIMEOUT_S = 5.0
_DEFAULT_WARNING_INTERVAL_S = 30.0
_DEFAULT_SILENCE_SECONDS = 30.0

FAIL_SAFES = ("keep_last", "standard_decoding")
SILENT_FALLBACK = SpeculationState(enabled=False, reasons=("decisions_silent",))
"""What `FlagClient.lookup` answers everywhere while silent with ``fail_safe="standard_decoding"``."""


@dataclass(frozen=True)
class FlagClientStats:
    """Counters of one `FlagClient` since it started (docs/SECURITY.md, "Monitor silence")."""

    applied: int
    changed: int
    undecodable: int
    tombstones: int
    connected: bool
    caught_up: bool
    reconnects: int
    heartbeats: int = 0
    forged: int = 0
    unsigned: int = 0
    replayed: int = 0
    misrouted: int = 0
    stale_heartbeats: int = 0
    silent: bool = False
    silences: int = 0
    watermark: float | None = None


class FlagClient:
    """Follows the decisions topic in a background thread and keeps a `FlagStore` current.

    ``lookup`` answers from memory at any time; silence and ``fail_safe``: docs/SECURITY.md.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DECISIONS_TOPIC,
                 store: FlagStore | None = None, connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S,
                 poll_timeout_ms: int = _DEFAULT_POLL_TIMEOUT_MS,
                 retry_backoff_s: float = _DEFAULT_RETRY_BACKOFF_S,
                 on_change: Callable[[Decision], None] | None = None,
                 keyring: Keyring | None = None,
                 silence_seconds: float | None = _DEFAULT_SILENCE_SECONDS,
                 fail_safe: str = "keep_last",
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if fail_safe not in FAIL_SAFES:
            raise ValueError(f"fail_safe must be one of {', '.join(FAIL_SAFES)}, got {fail_safe!r}")
        if silence_seconds is not None and not silence_seconds > 0:
            raise ValueError(f"silence_seconds must be positive (or None to never go silent), got {silence_seconds}")
        self.config = config
        self.topic = topic
        self.store = store if store is not None else FlagStore()
        self.keyring = keyring if keyring is not None else Keyring.from_env()
        self.silence_seconds = silence_seconds
        self.fail_safe = fail_safe
        if not self.keyring.enabled:
            warn_unsigned("the flag client")
        self._connect_timeout_s = connect_timeout_s
        self._poll_timeout_ms = poll_timeout_ms
        self._retry_backoff_s = retry_backoff_s
        self._on_change = on_change
        self._clock = clock
        self._wall_clock = wall_clock
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        # Where to pick up after a reconnect: replaying history from the beginning would
        # flip flags back through old states for a moment.
        self._next_offsets: dict[int, int] = {}
        self._counts: collections.Counter[str] = collections.Counter()  # FlagClientStats' counters
        # Replay defence: the newest decision time applied per scope, the newest heartbeat
        # time per publisher. Decisions of one scope come from one stage-2 task, in order.
        self._latest_ts: dict[tuple[str, str | None, str | None], float] = {}
        self._latest_beat: dict[str, float] = {}
        self._watermark: float | None = None
        self._state_lock = threading.Lock()
        self._last_heard = clock()  # silence is counted from the client's start
        self._silent = False
        self._last_rejection_warning = -float("inf")

    def start(self) -> "FlagClient":
        if self._thread is not None:
            raise RuntimeError("FlagClient already started")
        self._last_heard = self._clock()
        self._thread = threading.Thread(target=self._run, name="specwatch-flag-client", daemon=True)
        self._thread.start()
        return self

    def lookup(self, bundle_id: str, bucket: str, cohort: str) -> SpeculationState:
        if self.fail_safe == "standard_decoding" and self.silent:
            return SILENT_FALLBACK
        return self.store.lookup(bundle_id, bucket, cohort)

    @property
    def silent(self) -> bool:
        """Whether no fresh heartbeat or decision arrived for ``silence_seconds``."""
        if self.silence_seconds is None:
            return False
        silent = self._clock() - self._last_heard >= self.silence_seconds
        if silent != self._silent:
            self._transition(silent)
        return silent

    def wait_until_caught_up(self, timeout_s: float | None = None) -> bool:
        return self._caught_up.wait(timeout_s)

    def stats(self) -> FlagClientStats:
        silent = self.silent
        counted = {f.name: self._counts[f.name] for f in fields(FlagClientStats) if f.type == "int"}
        return FlagClientStats(**counted, connected=self._connected,
                               caught_up=self._caught_up.is_set(), silent=silent,
                               watermark=self._watermark)

    def stop(self, timeout_s: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("flag client thread did not stop within %g s", timeout_s)

    def __enter__(self) -> "FlagClient":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        backoff = self._retry_backoff_s
        last_warning = 0.0
        while not self._stop.is_set():
            reader = DecisionReader(self.config, topic=self.topic, connect_timeout_s=self._connect_timeout_s,
                                    include_heartbeats=True)
            try:
                reader.connect(resume_from=self._next_offsets)
                self._connected = True
                backoff = self._retry_backoff_s
                while not self._stop.is_set():
                    for decision, message in reader.poll(self._poll_timeout_ms):
                        self._fold(decision, message)
                    if not self._caught_up.is_set() and reader.caught_up:
                        self._caught_up.set()
                        logger.info("flag client caught up with %s: %d decisions applied",
                                    self.topic, self._counts["applied"])
                    self.silent  # noqa: B018 - logs a transition even when nobody looks up
            except Exception as error:  # noqa: BLE001 - keep following; flags stay as they were
                now = time.monotonic()
                if now - last_warning >= _DEFAULT_WARNING_INTERVAL_S:
                    logger.warning("flag client cannot follow %s (retrying every %.0f s at most): %s",
                                   self.topic, _DEFAULT_MAX_RETRY_BACKOFF_S, error)
                    last_warning = now
                self.silent  # noqa: B018
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _DEFAULT_MAX_RETRY_BACKOFF_S)
            finally:
                if self._connected:
                    self._counts["reconnects"] += 1
                self._connected = False
                reader.close()

    def _fold(self, decision: Decision | None, message: Any) -> None:
        self._next_offsets[message.partition] = message.offset + 1
        value = message.value
        if value is None:
            self._counts["tombstones"] += 1
            return
        verdict = verify(value, message.headers, self.keyring)
        if not verdict.accepted:
            counter = "unsigned" if verdict is Verdict.UNSIGNED else "forged"
            self._ignore(counter, message, verdict.value)
            return
        if decision is None:
            beat = decode_heartbeat(value)
            if beat is not None:
                self._heartbeat(beat, message)
                return
            self._counts["undecodable"] += 1
            logger.debug("skipping an undecodable message at %s[%d]@%d", message.topic,
                         message.partition, message.offset)
            return
        if message.key is not None and message.key != decision.key.encode():
            # The signature covers the value only; a decision under another scope's key
            # would survive compaction of the scope it names.
            self._ignore("misrouted", message)
            return
        scope = (decision.bundle_id, decision.bucket, decision.cohort)
        latest = self._latest_ts.get(scope)
        if latest is not None and decision.ts < latest:
            self._ignore("replayed", message)
            return
        self._latest_ts[scope] = decision.ts
        self._heard_at(message.timestamp / 1000.0 if message.timestamp is not None else None)
        self._counts["applied"] += 1
        if self.store.apply(decision):
            self._counts["changed"] += 1
            if self._on_change is not None:
                try:
                    self._on_change(decision)
                except Exception:  # noqa: BLE001 - a listener bug must not stop flag updates
                    logger.exception("flag change listener failed")

    def _heartbeat(self, beat: Heartbeat, message: Any) -> None:
        if message.key is not None and message.key != beat.key.encode():
            self._ignore("misrouted", message)
            return
        latest = self._latest_beat.get(beat.publisher)
        if latest is not None and beat.wall_time <= latest:
            self._ignore("replayed", message)
            return
        self._latest_beat[beat.publisher] = beat.wall_time
        self._counts["heartbeats"] += 1
        if beat.watermark is not None and (self._watermark is None or beat.watermark > self._watermark):
            self._watermark = beat.watermark
        if not self._heard_at(beat.wall_time):
            # history read at start, or a publisher far behind
            self._counts["stale_heartbeats"] += 1

    def _heard_at(self, wall_time: float | None) -> bool:
        """Count a message sent at ``wall_time`` as a sign of life, if it is recent enough."""
        if wall_time is None:
            return False
        if self.silence_seconds is None:
            return True
        age = max(0.0, self._wall_clock() - wall_time)
        if age >= self.silence_seconds:
            return False
        heard = self._clock() - age
        with self._state_lock:
            if heard > self._last_heard:
                self._last_heard = heard
        self.silent  # noqa: B018 - logs the way back from silence at once
        return True

    def _transition(self, silent: bool) -> None:
        with self._state_lock:
            if silent == self._silent:
                return  # another thread logged it
            self._silent = silent
            if silent:
                self._counts["silences"] += 1
        if silent:
            logger.warning("no heartbeat or decision on %s for %.0f s: the monitor is silent; %s", self.topic,
                           self.silence_seconds, "speculation is OFF everywhere until it resumes"
                           if self.fail_safe == "standard_decoding" else "keeping the last known flags")
        else:
            logger.warning("heartbeats on %s resumed: flags answer from decisions again", self.topic)

    def _ignore(self, counter: str, message: Any, why: str | None = None) -> None:
        """Count an ignored message; warn, rate-limited, never quoting its value."""
        self._counts[counter] += 1
        now = self._clock()
        if now - self._last_rejection_warning >= _DEFAULT_WARNING_INTERVAL_S:
            self._last_rejection_warning = now
            so_far = [self._counts[name] for name in ("forged", "unsigned", "replayed",
                                                      "misrouted")]
            logger.warning("ignored a %s message at %s[%d]@%d (so far: %d forged, %d unsigned, %d replayed, "
                           "%d misrouted)", why or counter, message.topic, message.partition,
                           message.offset, *so_far)
