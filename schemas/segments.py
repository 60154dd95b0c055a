"""Numbered, append-only segment files in one directory: where the engine's telemetry spool and the
archive sink's outage spool keep their frames (docs/RELIABILITY.md)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["SET_ASIDE_SUFFIX", "SegmentFiles"]

# Bytes a spool could not deliver are kept beside their segment under its name and this suffix,
# for a person to look at; nothing a spool drops is deleted unseen.
SET_ASIDE_SUFFIX = ".bad"


class SegmentFiles:
    """Segments named ``prefix``, a ``digits``-wide number and ``suffix``; the newest takes appends
    until the next frame would pass ``segment_bytes``. With ``fsync`` every append and every new
    name reach the disk. ``sizes`` holds each segment's bytes, oldest first.

    >>> import tempfile
    >>> files = SegmentFiles(tempfile.mkdtemp(), "s-", 4, ".log", segment_bytes=8)
    >>> [files.write(b"abcde") for _ in range(3)], [files.path(n).name for n in files.sizes]
    ([(0, 0), (1, 0), (2, 0)], ['s-0000.log', 's-0001.log', 's-0002.log'])
    """

    def __init__(self, directory: str | os.PathLike, prefix: str, digits: int, suffix: str, *,
                 segment_bytes: int, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._name = f"{prefix}{{:0{digits}d}}{suffix}"
        self._pattern = re.compile(rf"{re.escape(prefix)}(\d{{{digits}}}){re.escape(suffix)}")
        self.sizes: dict[int, int] = {}
        self._writer: Any = None
        self._writer_number: int | None = None
        self.rescan()

    def rescan(self) -> None:
        """Read the directory again: segments other processes added, grew or removed since. The
        segment taking appends is let go when it is no longer the newest."""
        sizes = {}
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    match = self._pattern.fullmatch(entry.name)
                    if match:
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                            if entry.is_file():
                                sizes[int(match.group(1))] = entry.stat().st_size
        except FileNotFoundError:  # no directory yet: no segments
            pass
        sizes = dict(sorted(sizes.items()))
        self.sizes = sizes
        if self._writer is not None and self._writer_number != self.last:
            self.close_writer()

    @property
    def last(self) -> int | None:
        """The newest segment's number; None when there is none."""
        return next(reversed(self.sizes), None)

    def path(self, number: int) -> Path:
        return self.directory / self._name.format(number)

    def write(self, frame: bytes, *, sealed: int | None = None) -> tuple[int, int]:
        """Append one frame, in a new segment when it would not fit or the last write failed;
        returns (segment, offset). With ``sealed`` (segments up to that number take no more
        appends; -1: none) segments are shared: the newest one past it takes the frame whoever
        began it, and a new one is numbered past it. The caller keeps other writers out meanwhile."""
        try:
            if sealed is not None:
                self._join_newest(sealed, len(frame))
            size = self.sizes[self.last] if self._writer is not None else 0
            if self._writer is None or size and size + len(frame) > self.segment_bytes:
                self._roll(sealed)
                size = 0
            self._writer.write(frame)
            self._writer.flush()  # in the page cache: a crash of the process loses nothing
            if self.fsync:
                os.fsync(self._writer.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                self.close_writer()
            self._writer = None
            raise
        self.sizes[self.last] = size + len(frame)
        return self.last, size

    def _join_newest(self, sealed: int, size: int) -> None:
        """Append to the newest segment past ``sealed`` with room for ``size`` more bytes, if any."""
        last = self.last
        if self._writer is not None and (self._writer_number != last or last <= sealed):
            self.close_writer()
        if self._writer is None and last is not None and last > sealed and (
                not self.sizes[last] or self.sizes[last] + size <= self.segment_bytes):
            self._writer = open(self.path(last), "ab")  # noqa: SIM115 - kept open across appends
            self._writer_number = last

    def _roll(self, sealed: int | None = None) -> None:
        self.close_writer()
        self.directory.mkdir(parents=True, exist_ok=True)
        number = max(0 if self.last is None else self.last + 1, -1 if sealed is None else sealed + 1)
        # O_EXCL: never append to a segment a reader may be working through; O_APPEND: every
        # frame at the end, also where other writers append to the same segment (their frames
        # would be overwritten from this writer's own file position otherwise).
        descriptor = os.open(self.path(number), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._writer = open(descriptor, "wb")  # noqa: SIM115 - kept open across appends
        self._writer_number = number
        self.sizes[number] = 0
        if self.fsync:
            with contextlib.suppress(OSError):  # the new name survives a crash too
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def set_aside(self, number: int, data: bytes) -> Path:
        """Append ``data`` (frames that cannot be delivered) to the segment's set-aside file
        beside it, on disk when this returns; returns that file. Numbers are reused once a
        directory empties, so an earlier set-aside file of the same name is added to, never replaced."""
        target = self.path(number).with_name(self.path(number).name + SET_ASIDE_SUFFIX)
        with open(target, "ab") as kept:
            kept.write(data)
            kept.flush()
            os.fsync(kept.fileno())
        return target

    def set_aside_files(self) -> list[Path]:
        """The set-aside files in the directory, oldest segment first."""
        return sorted(p for p in self.directory.glob(f"*{SET_ASIDE_SUFFIX}") if p.is_file())

    def remove(self, number: int) -> None:
        """Forget one segment and delete its file."""
        self.sizes.pop(number, None)
        self.path(number).unlink(missing_ok=True)

    def close_writer(self) -> None:
        """Close the segment taking appends; the next write starts a new one."""
        if self._writer is not None:
            writer, self._writer, self._writer_number = self._writer, None, None
            writer.close()
