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
        pattern = re.compile(rf"{re.escape(prefix)}(\d{{{digits}}}){re.escape(suffix)}")
        found = [(pattern.fullmatch(path.name), path) for path in self.directory.glob(f"{prefix}*{suffix}")]
        self.sizes = {int(match.group(1)): path.stat().st_size
                      for match, path in sorted(found, key=lambda item: item[1].name)
                      if match and path.is_file()}
        self._writer: Any = None

    @property
    def last(self) -> int | None:
        """The newest segment's number; None when there is none."""
        return next(reversed(self.sizes), None)

    def path(self, number: int) -> Path:
        return self.directory / self._name.format(number)

    def write(self, frame: bytes) -> tuple[int, int]:
        """Append one frame, in a new segment when it would not fit or the last write failed;
        returns (segment, offset)."""
        try:
            size = self.sizes[self.last] if self._writer is not None else 0
            if self._writer is None or size and size + len(frame) > self.segment_bytes:
                self._roll()
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

    def _roll(self) -> None:
        self.close_writer()
        self.directory.mkdir(parents=True, exist_ok=True)
        number = 0 if self.last is None else self.last + 1
        # "x": never append to a segment a reader may be working through.
        self._writer = open(self.path(number), "xb")  # noqa: SIM115 - kept open across appends
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
            writer, self._writer = self._writer, None
            writer.close()
