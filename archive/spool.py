"""A local, bounded, append-only spool of JSON entries in CRC-framed segment files: what the
archive could not take waits here until it can."""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specwatch.archive.jsonvalue import canonical_json
from specwatch.schemas.segments import SegmentFiles

__all__ = ["Spool", "SpoolFull", "SpoolStats"]

logger = logging.getLogger(__name__)

# Big enough for hours of decisions and window stats of a large fleet; small enough that
# a full spool is a clear signal, not a full disk.
_DEFAULT_MAX_BYTES = 256 << 20
# A segment is replayed as one batch: this bounds the memory a replay takes.
_DEFAULT_SEGMENT_BYTES = 4 << 20
_QUARANTINE_SUFFIX = ".bad"


class SpoolFull(RuntimeError):
    """The spool reached its size bound; the entry was not kept."""


@dataclass(frozen=True)
class SpoolStats:
    """Entries replayed, refused because the spool was full, skipped as torn or corrupt; segments
    set aside because the archive refused their content; bytes waiting now."""

    replayed: int
    refused_full: int
    corrupt: int
    quarantined: int
    pending_bytes: int


def _frame(entry: Mapping[str, Any]) -> bytes:
    payload = canonical_json(entry, keep_nan=True).encode("utf-8")
    return b"%08x %d " % (zlib.crc32(payload), len(payload)) + payload + b"\n"


def _unframe(line: bytes) -> dict | None:
    """The entry in one framed line, or None when it is torn or corrupt."""
    try:
        crc, length, payload = line.rstrip(b"\n").split(b" ", 2)
        if len(payload) != int(length) or zlib.crc32(payload) != int(crc, 16):
            return None
        entry = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return entry if isinstance(entry, dict) else None


class Spool:
    """Segment files under ``directory`` (created on the first append; earlier processes' segments
    are replayed), at most ``max_bytes`` in all; one writer at a time. ``segment_bytes`` bounds what
    one replay reads at once; ``fsync`` makes every append survive a crash of the host.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     spool = Spool(tmp, fsync=False)
    ...     spool.append({"k": "windows", "rows": [{"speedup": float("nan")}]})
    ...     seen = []
    ...     spool.replay(seen.extend)
    ...     seen[0]["rows"][0]["speedup"], spool.empty
    1
    (nan, True)
    """

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = _DEFAULT_MAX_BYTES,
                 segment_bytes: int = _DEFAULT_SEGMENT_BYTES, fsync: bool = True) -> None:
        if max_bytes <= 0 or segment_bytes <= 0:
            raise ValueError(f"max_bytes and segment_bytes must be positive, got {max_bytes} and {segment_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._files = SegmentFiles(self.directory, "spool-", 12, ".log",
                                   segment_bytes=min(segment_bytes, max_bytes), fsync=fsync)
        self._lock = threading.Lock()
        self._replayed = self._refused = self._corrupt = self._quarantined = 0
        if self._files.sizes:
            logger.info("archive spool %s holds %d bytes from an earlier run; they will be replayed",
                        self.directory, self.pending_bytes)

    def append(self, entry: Mapping[str, Any]) -> None:
        """Keep one entry. Raises `SpoolFull` past the bound, OSError if the disk refuses."""
        frame = _frame(entry)
        with self._lock:
            if self.pending_bytes + len(frame) > self.max_bytes:
                self._refused += 1
                raise SpoolFull(f"archive spool {self.directory} is full ({self.pending_bytes} of "
                                f"{self.max_bytes} bytes)")
            self._files.write(frame)

    @property
    def pending_bytes(self) -> int:
        return sum(self._files.sizes.values())

    @property
    def empty(self) -> bool:
        return not self._files.sizes

    def replay(self, write: Callable[[list[dict]], None]) -> int:
        """Hand each segment's entries, oldest first, to ``write`` (idempotent); returns how many. A
        segment is deleted once written; when ``write`` raises it stays and the error propagates,
        except ValueError or TypeError (content refused): that segment is set aside as ``*.bad``."""
        replayed = 0
        with self._lock:
            self._files.close_writer()  # appends from now on start a new segment
            numbers = list(self._files.sizes)
        for number in numbers:
            path = self._files.path(number)
            entries = list(self._read(path))
            try:
                if entries:
                    write(entries)
            except (ValueError, TypeError) as error:
                self._quarantine(number, path, error)
                continue
            with self._lock:
                self._files.remove(number)
                self._replayed += len(entries)
            replayed += len(entries)
        return replayed

    def _read(self, path: Path) -> Iterator[dict]:
        try:
            with open(path, "rb") as segment:
                for line in segment:
                    entry = _unframe(line)
                    if entry is None:
                        self._corrupt += 1
                        logger.error("archive spool %s: skipping a torn or corrupt entry", path)
                        continue
                    yield entry
        except FileNotFoundError:
            return

    def _quarantine(self, number: int, path: Path, error: BaseException) -> None:
        target = path.with_name(path.name + _QUARANTINE_SUFFIX)
        try:
            path.rename(target)
        except OSError:
            target = path
        with self._lock:
            self._files.sizes.pop(number, None)
            self._quarantined += 1
        logger.error("archive spool: the archive refused the content of %s (%s); set aside as %s for a "
                     "person to look at", path.name, error, target)

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._replayed, self._refused, self._corrupt, self._quarantined,
                              self.pending_bytes)

    def close(self) -> None:
        with self._lock:
            self._files.close_writer()

    def __repr__(self) -> str:
        return f"Spool({str(self.directory)!r}, pending_bytes={self.pending_bytes})"
