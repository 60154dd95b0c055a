"""The engine-side telemetry spool: Kafka messages kept on local disk while the broker is away
(design, limits and frame layout: docs/RELIABILITY.md, "The engine's telemetry spool")."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

from specwatch.schemas.segments import SegmentFiles

__all__ = ["SpoolFrame", "SpoolStats", "TelemetrySpool"]

logger = logging.getLogger(__name__)

_DEFAULT_MAX_BYTES = 256 << 20
_DEFAULT_MAX_AGE_SECONDS = 6 * 3600.0
_DEFAULT_SEGMENT_BYTES = 16 << 20
_HEADER = struct.Struct("<II")
_META = struct.Struct("<dIH")
_CURSOR = "cursor"
_LOCK = ".lock"
_OFF = ("none", "off")


class SpoolFrame(NamedTuple):
    """One spooled Kafka message."""

    key: bytes
    payload: bytes
    records: int
    written_at: float


@dataclass(frozen=True)
class SpoolStats:
    """Counters since the spool was opened, and what it holds now."""

    pending_records: int
    pending_bytes: int
    spooled: int
    drained: int
    dropped_full: int
    dropped_expired: int
    dropped_unwritable: int
    corrupt_frames: int
    set_aside_bytes: int = 0


class TelemetrySpool:
    """A bounded on-disk FIFO of Kafka messages, for one exporter process at a time (a second one
    gets ValueError); ``clock`` is wall time, so the age limit holds across restarts.

    >>> import tempfile
    >>> spool = TelemetrySpool(tempfile.mkdtemp(), max_bytes=200)
    >>> [spool.append(b"w1", bytes(40), records=3) for _ in range(4)]
    [True, True, True, False]
    >>> [(frame.key, frame.records) for frame in spool.head(2)]
    [(b'w1', 3), (b'w1', 3)]
    >>> spool.commit(1); s = spool.stats(); s.pending_records, s.drained, s.dropped_full
    (6, 3, 3)
    >>> spool.close()
    """

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = _DEFAULT_MAX_BYTES,
                 max_age_seconds: float = _DEFAULT_MAX_AGE_SECONDS, segment_bytes: int = _DEFAULT_SEGMENT_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_age_seconds", max_age_seconds),
                            ("segment_bytes", segment_bytes)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.max_age_seconds = max_age_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.directory / _LOCK, "a+b")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(f"telemetry spool {self.directory} is in use by another process; "
                             "give each engine process its own SPECWATCH_TELEMETRY_SPOOL_DIR") from None
        self._counts = dict(spooled=0, drained=0, dropped_full=0, dropped_expired=0, dropped_unwritable=0,
                            corrupt_frames=0, set_aside_bytes=0)
        # pending frames, oldest first: (segment number, offset, frame size, records)
        self._index: list[tuple[int, int, int, int]] = []
        self._head = 0  # index of the oldest pending frame in _index
        self._pending_bytes = 0
        self._pending_records = 0
        self._files = SegmentFiles(self.directory, "", 16, ".seg", segment_bytes=segment_bytes)
        self._open_existing()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, name: str) -> "TelemetrySpool | None":
        """The spool ``SPECWATCH_TELEMETRY_SPOOL_*`` describe; None when it is turned off. ``_DIR``
        (default ``~/.cache/specwatch/telemetry-spool/<name>``; ``none`` turns it off),
        ``_MAX_BYTES`` (default 256 MiB) and ``_MAX_AGE_SECONDS`` (default 6 h)."""
        environ = os.environ if environ is None else environ
        directory = (environ.get("SPECWATCH_TELEMETRY_SPOOL_DIR") or "").strip()
        if directory.lower() in _OFF:
            return None
        if not directory:
            cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            directory = os.path.join(cache, "specwatch", "telemetry-spool", name)
        settings = {}
        for variable, setting, kind in (("SPECWATCH_TELEMETRY_SPOOL_MAX_BYTES", "max_bytes", int),
                                        ("SPECWATCH_TELEMETRY_SPOOL_MAX_AGE_SECONDS", "max_age_seconds", float)):
            value = (environ.get(variable) or "").strip()
            if value:
                try:
                    settings[setting] = kind(value)
                except ValueError:
                    raise ValueError(f"{variable} must be a number, got {value!r}") from None
        try:
            return cls(directory, **settings)
        except ValueError:
            if (environ.get("SPECWATCH_TELEMETRY_SPOOL_DIR") or "").strip():
                raise  # a directory named on purpose is not replaced behind the operator's back
        # Two engine processes with the same name on one host: the second gets its own.
        fallback = f"{directory}-{os.getpid()}"
        logger.warning("telemetry spool %s is in use by another process; this one spools to %s "
                       "(name each engine worker to keep its spool across restarts)", directory, fallback)
        return cls(fallback, **settings)

    def _open_existing(self) -> None:
        try:
            start_segment, start_offset = map(int, (self.directory / _CURSOR).read_text().split())
        except (OSError, ValueError):
            start_segment, start_offset = next(iter(self._files.sizes), 0), 0
        for number in list(self._files.sizes):
            if number < start_segment:
                self._files.remove(number)
                continue
            end = self._scan(number, start_offset if number == start_segment else 0)
            if end < self._files.sizes[number]:
                # Past a bad length no frame boundary can be trusted: the rest of the segment is
                # kept aside with its bytes (valid frames after the bad one included), not deleted.
                with open(self._files.path(number), "rb") as segment:
                    segment.seek(end)
                    rest = segment.read()
                kept = self._files.set_aside(number, rest)
                self._counts["corrupt_frames"] += 1
                self._counts["set_aside_bytes"] += len(rest)
                logger.error("telemetry spool %s: segment %d has a torn or corrupt frame at byte %d; its last "
                             "%d bytes are kept in %s, not sent", self.directory, number, end, len(rest), kept)
                os.truncate(self._files.path(number), end)
                self._files.sizes[number] = end
        if self._index:
            logger.info("telemetry spool %s: %d records in %d bytes left from before; they go first",
                        self.directory, self._pending_records, self._pending_bytes)

    def _scan(self, number: int, offset: int) -> int:
        """Index the valid frames of a segment from ``offset``; returns where they end."""
        with open(self._files.path(number), "rb") as f:
            f.seek(offset)
            while True:
                header = f.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    return offset
                length, crc = _HEADER.unpack(header)
                body = f.read(length)
                if len(body) < length or zlib.crc32(body) != crc or length < _META.size:
                    return offset
                _, records, _ = _META.unpack_from(body)
                size = _HEADER.size + length
                self._index.append((number, offset, size, records))
                self._pending_bytes += size
                self._pending_records += records
                offset += size

    def append(self, key: bytes, payload: bytes, *, records: int) -> bool:
        """Add one message at the end; False (counted as ``dropped_full``) when it does not fit."""
        body = _META.pack(self._clock(), records, len(key)) + key + payload
        frame = _HEADER.pack(len(body), zlib.crc32(body)) + body
        with self._lock:
            if self._pending_bytes + len(frame) > self.max_bytes:
                self._counts["dropped_full"] += records
                return False
            try:
                number, offset = self._files.write(frame)
            except OSError as error:  # a full or failing disk: drop and count, never raise into the exporter
                self._counts["dropped_unwritable"] += records
                logger.warning("telemetry spool %s cannot write (%s); %d records dropped",
                               self.directory, error.strerror or error, records)
                return False
            self._index.append((number, offset, len(frame), records))
            self._pending_bytes += len(frame)
            self._pending_records += records
            self._counts["spooled"] += records
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) - self._head

    def head(self, limit: int = 1) -> list[SpoolFrame]:
        """Up to ``limit`` of the oldest pending frames, in order; expired ones are dropped first."""
        now = self._clock()
        frames: list[SpoolFrame] = []
        with self._lock, contextlib.ExitStack() as opened:
            readers: dict[int, BinaryIO] = {}
            position = self._head
            while position < len(self._index) and len(frames) < limit:
                number, offset, size, _ = self._index[position]
                if number not in readers:
                    readers[number] = opened.enter_context(open(self._files.path(number), "rb"))
                readers[number].seek(offset)
                body = readers[number].read(size)[_HEADER.size:]
                written_at, records, key_length = _META.unpack_from(body)
                if not frames and now - written_at > self.max_age_seconds:
                    self._counts["dropped_expired"] += self._advance(1)
                    position = self._head
                    continue
                start = _META.size
                frames.append(SpoolFrame(body[start:start + key_length], body[start + key_length:], records,
                                         written_at))
                position += 1
        return frames

    def commit(self, count: int) -> None:
        """The oldest ``count`` frames were delivered: forget them (and delete drained segments)."""
        with self._lock:
            self._counts["drained"] += self._advance(count)

    def _advance(self, count: int) -> int:
        """Forget the oldest ``count`` frames; returns how many records they held."""
        gone = self._index[self._head:self._head + count]
        records = sum(frame[3] for frame in gone)
        self._pending_bytes -= sum(frame[2] for frame in gone)
        self._pending_records -= records
        self._head += count
        if self._head == len(self._index):
            self._index, self._head = [], 0
            last = self._files.last
            cursor = None if last is None else (last, self._files.sizes[last])
        else:
            cursor = self._index[self._head][:2]
            if self._head > 4096:  # keep the index from growing with what is already gone
                self._index, self._head = self._index[self._head:], 0
        if cursor is not None:
            temporary = self.directory / (_CURSOR + ".tmp")
            temporary.write_text(f"{cursor[0]} {cursor[1]}\n")
            os.replace(temporary, self.directory / _CURSOR)
            for number in [n for n in self._files.sizes if n < cursor[0]]:
                self._files.remove(number)
        return records

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._pending_records, self._pending_bytes, **self._counts)

    def close(self) -> None:
        """Close the files and release the directory; what is pending stays for the next process."""
        with self._lock:
            self._files.close_writer()
            self._lock_file.close()
