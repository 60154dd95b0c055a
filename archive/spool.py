"""A local, bounded, append-only spool of JSON entries in CRC-framed segment files: what the
archive could not take waits here until it can."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from specwatch.archive.jsonvalue import canonical_json
from specwatch.schemas.segments import SegmentFiles

__all__ = ["SetAside", "Spool", "SpoolBusy", "SpoolFull", "SpoolStats", "describe_kinds"]

logger = logging.getLogger(__name__)

# Big enough for hours of decisions and window stats of a large fleet; small enough that
# a full spool is a clear signal, not a full disk.
_DEFAULT_MAX_BYTES = 256 << 20
# A segment is replayed as one batch: this bounds the memory a replay takes.
_DEFAULT_SEGMENT_BYTES = 4 << 20
_LOCK = ".lock"
# Appends of every process take this file's lock; it holds the number of the last segment a
# delivery took, which takes no more appends.
_APPEND_LOCK = ".append-lock"
# The kind of an entry whose frame no longer parses, read from its bytes (canonical JSON writes
# "k" without spaces) so a report can say what was lost.
_KIND = re.compile(rb'"k":"([A-Za-z_]{1,32})"')


class SpoolFull(RuntimeError):
    """The spool reached its size bound; the entry was not kept."""


class SpoolBusy(RuntimeError):
    """Another process is delivering this spool now."""


@dataclass(frozen=True)
class SpoolStats:
    """Entries replayed, refused because the spool was full, set aside because their frame was torn
    or corrupt, set aside because their content is not a row (or the archive refused it), by kind;
    bytes waiting now."""

    replayed: int
    refused_full: int
    corrupt: int
    quarantined: int
    pending_bytes: int
    set_aside: Mapping[str, int] = field(default_factory=dict)


class SetAside(NamedTuple):
    """A file of entries a spool could not deliver, and how many of each kind it holds."""

    path: Path
    kinds: Counter


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


def _kind(line: bytes) -> str:
    """The kind named in a frame's bytes, or "unknown".

    >>> _kind(b'0badc0de 31 {"k":"decision","line":"{\\"ts"'), _kind(b"garbage")
    ('decision', 'unknown')
    """
    found = _KIND.search(line)
    return found.group(1).decode() if found else "unknown"


class Spool:
    """Segment files under ``directory`` (created on the first append; earlier processes' segments
    are replayed), at most ``max_bytes`` in all. Processes may share the directory: one append at a
    time across them (a lock file), each frame whole in the newest segment, and one replay at a
    time (another lock file), which seals the segments it takes so that no append lands in them.
    ``segment_bytes`` bounds what one replay reads at once; ``fsync`` makes every append survive a
    crash of the host.

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
        self._held: Any = None  # the lock file while this process holds the spool
        self._replayed = self._refused = self._corrupt = self._quarantined = 0
        self._set_aside: Counter = Counter()
        if self._files.sizes:
            logger.info("archive spool %s holds %d bytes from an earlier run; they will be replayed",
                        self.directory, self.pending_bytes)

    def append(self, entry: Mapping[str, Any]) -> None:
        """Keep one entry. Raises `SpoolFull` past the bound, OSError if the disk refuses."""
        frame = _frame(entry)
        with self._lock, self._appending() as sealed:
            self._files.rescan()  # what other processes appended or delivered meanwhile
            if self.pending_bytes + len(frame) > self.max_bytes:
                self._refused += 1
                raise SpoolFull(f"archive spool {self.directory} is full ({self.pending_bytes} of "
                                f"{self.max_bytes} bytes)")
            self._files.write(frame, sealed=sealed.number)

    @contextlib.contextmanager
    def _appending(self) -> Iterator["_Seal"]:
        """This process alone appends (or seals) until the block ends; yields the seal."""
        self.directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.directory / _APPEND_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield _Seal(descriptor)
        finally:
            os.close(descriptor)  # lets go of the lock too

    @property
    def pending_bytes(self) -> int:
        return sum(self._files.sizes.values())

    @property
    def empty(self) -> bool:
        return not self._files.sizes

    def hold(self) -> None:
        """Take the spool for this process until `close` (what `archive flush` does before it
        opens the archive); `SpoolBusy` when another process is delivering it."""
        if self._held is not None or not self.directory.is_dir():
            return
        lock_file = open(self.directory / _LOCK, "a+b")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            raise SpoolBusy(f"another process is delivering the archive spool {self.directory} now") from None
        self._held = lock_file

    def _release(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.close()

    def replay(self, write: Callable[[list[dict]], None], check: Callable[[dict], str | None] | None = None) -> int:
        """Hand each segment's entries, oldest first, to ``write`` (idempotent); returns how many.

        An entry whose frame is torn or corrupt, or whose content ``check`` refuses (it returns
        why), is set aside with its bytes in a file beside its segment (`set_aside_files`) and the
        rest go on. A segment is deleted once its entries are written and the others kept aside;
        when ``write`` raises, it stays and the error propagates, except ValueError or TypeError
        (the archive refused the content): then the whole segment is set aside. `SpoolBusy` when
        another process is replaying this spool."""
        holding = self._held is None
        if holding:
            self.hold()
        try:
            return self._replay(write, check)
        finally:
            if holding:
                self._release()

    def _replay(self, write, check) -> int:
        replayed = 0
        if not self.directory.is_dir():
            return 0
        with self._lock, self._appending() as sealed:
            self._files.rescan()
            self._files.close_writer()
            numbers = list(self._files.sizes)
            if numbers:
                sealed.number = numbers[-1]  # every process's appends from now on start a new segment
        for number in numbers:
            path = self._files.path(number)
            entries, bad = self._read(path, check)
            self._corrupt += sum(torn for *_, torn in bad)
            try:
                if entries:
                    write(entries)
            except (ValueError, TypeError) as error:
                self._set_aside_segment(number, path, error)
                continue
            if bad:
                kept = self._files.set_aside(number, b"".join(line for line, *_ in bad))
                kinds = Counter(kind for _, kind, *_ in bad)
                self._set_aside.update(kinds)
                logger.error("archive spool %s: %d entries could not be delivered (%s; first: %s); kept in %s",
                             path.name, len(bad), describe_kinds(kinds), bad[0][2], kept)
            with self._lock:
                self._files.remove(number)
                self._replayed += len(entries)
            replayed += len(entries)
        return replayed

    def _read(self, path: Path, check) -> tuple[list[dict], list[tuple[bytes, str, str, bool]]]:
        """The segment's good entries, and its bad frames as (bytes, kind, why, torn or corrupt)."""
        entries, bad = [], []
        try:
            with open(path, "rb") as segment:
                for line in segment:
                    entry = _unframe(line)
                    if entry is None:
                        why = "a torn or corrupt frame" if line.endswith(b"\n") else "a torn last frame"
                        bad.append((line if line.endswith(b"\n") else line + b"\n", _kind(line), why, True))
                        continue
                    problem = check(entry) if check is not None else None
                    if problem is not None:
                        bad.append((line, str(entry.get("k"))[:32] or "unknown", problem, False))
                        continue
                    entries.append(entry)
        except FileNotFoundError:
            pass
        return entries, bad

    def entries(self) -> Iterator[dict]:
        """Every entry waiting now, oldest first, read without taking it (bad frames left out)."""
        if not self.directory.is_dir():
            return
        with self._lock, self._appending():
            self._files.rescan()
            numbers = list(self._files.sizes)
        for number in numbers:
            yield from self._read(self._files.path(number), None)[0]

    def _set_aside_segment(self, number: int, path: Path, error: BaseException) -> None:
        data = path.read_bytes()
        kinds = Counter(_kind(line) for line in data.splitlines())
        target = self._files.set_aside(number, data)
        with self._lock:
            self._files.remove(number)
            self._quarantined += 1
            self._set_aside.update(kinds)
        logger.error("archive spool: the archive refused the content of %s (%s); its %d entries (%s) set aside "
                     "in %s for a person to look at", path.name, error, sum(kinds.values()), describe_kinds(kinds), target)

    def set_aside_files(self) -> list[SetAside]:
        """Every file of entries this spool could not deliver (this run or an earlier one), with
        how many of each kind it holds; they stay until a person removes them."""
        found = []
        for path in self._files.set_aside_files():
            try:
                kinds = Counter(_kind(line) for line in path.read_bytes().splitlines())
            except OSError:
                continue
            found.append(SetAside(path, kinds))
        return found

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._replayed, self._refused, self._corrupt, self._quarantined,
                              self.pending_bytes, dict(self._set_aside))

    def close(self) -> None:
        with self._lock:
            self._files.close_writer()
        self._release()

    def __repr__(self) -> str:
        return f"Spool({str(self.directory)!r}, pending_bytes={self.pending_bytes})"


class _Seal:
    """The last segment a delivery took (-1: none), kept in the append lock file: appends go past it."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        text = os.pread(descriptor, 32, 0).strip()
        self._number = int(text) if text.isdigit() else -1

    @property
    def number(self) -> int:
        return self._number

    @number.setter
    def number(self, value: int) -> None:
        text = b"%d\n" % value
        os.pwrite(self._descriptor, text, 0)
        os.ftruncate(self._descriptor, len(text))
        self._number = value


def describe_kinds(kinds: Mapping[str, int]) -> str:
    """Counts by kind in one phrase.

    >>> describe_kinds({"windows": 2, "decision": 1})
    '1 decision, 2 windows'
    """
    return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
