"""Damaged spools, on real files, delivered into a real chDB archive by `specwatch archive flush`: what
cannot be delivered is kept beside its segment with its bytes, counted by kind and reported with a
non-zero exit; it never blocks what comes after; two flushes at once deliver each row once."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

from test_archive_outage import _Clock, _contents, _expected, _outputs

from specwatch.archive.sink import ArchiveSink, spool_dir_for
from specwatch.archive.spool import Spool
from specwatch.archive.store import Archive
from specwatch.transport.telemetry_spool import TelemetrySpool

from machine import CLI, specwatch

_EXIT_SET_ASIDE = 3


def _environ(tmp_path: Path) -> dict:
    env = dict(os.environ, SPECWATCH_ARCHIVE_SPOOL=str(tmp_path / "spool"))
    env.pop("SPECWATCH_ARCHIVE", None)
    return env


def _spooled(tmp_path: Path) -> tuple[str, Path]:
    """Every seeded slice spooled for a chDB archive that was away; (its DSN, its spool directory)."""
    dsn = f"chdb://{tmp_path / 'archive'}"
    directory = spool_dir_for(dsn, _environ(tmp_path))
    sink = ArchiveSink(lambda: (_ for _ in ()).throw(ConnectionError("archive away")), spool=directory,
                       clock=_Clock())
    for output in _outputs():
        sink(output)
    sink.flush()
    sink.spool.close()
    Archive.open(dsn).close()  # the archive exists, empty, when the flush comes
    return dsn, directory


def _flush(tmp_path: Path, dsn: str) -> subprocess.CompletedProcess:
    return specwatch("archive", "flush", "--archive", dsn, env=_environ(tmp_path), cwd=tmp_path, timeout=600)


def _segment(directory: Path) -> Path:
    (segment,) = sorted(directory.glob("spool-*.log"))
    return segment


def _archived(dsn: str) -> dict:
    with Archive.open(dsn, create=False) as archive:
        return _contents(archive)


def test_a_frame_that_is_not_a_row_is_set_aside_and_blocks_nothing_after_it(tmp_path):
    dsn, directory = _spooled(tmp_path)
    spool = Spool(directory)
    spool.append({"k": "decision", "bogus": 1})  # a valid CRC around content that is no row
    spool.close()

    bogus = sorted(directory.glob("spool-*.log"))[-1]
    flushed = _flush(tmp_path, dsn)
    assert flushed.returncode == _EXIT_SET_ASIDE, flushed.stderr
    kept = Path(str(bogus) + ".bad")
    assert flushed.stderr.strip().splitlines()[-1] == (
        f"specwatch archive flush: error: 1 spooled entries could not be delivered (1 decision): torn, corrupt "
        f"or not rows; kept in {kept} for a person to look at (remove it once done)")
    assert [json.loads(line.split(b" ", 2)[2]) for line in kept.read_bytes().splitlines()] == [
        {"k": "decision", "bogus": 1}]
    assert _archived(dsn) == _expected(_outputs())  # every real row arrived, once
    assert not list(directory.glob("spool-*.log"))

    # the next run into the healthy archive writes straight through: no false outage
    with Archive.open(dsn, create=False) as archive:
        sink = ArchiveSink(archive, spool=directory)
        sink(_outputs()[0])
        sink.flush()
        assert (sink.stats()["spooled"], sink.stats()["archive_down"]) == (0, False)
        sink.close()
    again = _flush(tmp_path, dsn)  # still reported until a person removes it
    assert again.returncode == _EXIT_SET_ASIDE and "nothing spooled in" in again.stdout


def test_a_flipped_byte_in_a_decision_frame_is_reported_and_kept_not_deleted(tmp_path):
    dsn, directory = _spooled(tmp_path)
    segment = _segment(directory)
    lines = segment.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if b'"k":"decision"' in line)
    damaged = bytearray(lines[index])
    damaged[len(damaged) // 2] ^= 0x01
    lines[index] = bytes(damaged)
    segment.write_bytes(b"".join(lines))

    flushed = _flush(tmp_path, dsn)
    assert flushed.returncode == _EXIT_SET_ASIDE, flushed.stderr
    assert "1 spooled entries could not be delivered (1 decision)" in flushed.stderr
    assert "delivered to the archive" in flushed.stdout  # the rest went
    kept = Path(str(segment) + ".bad")
    assert kept.read_bytes() == bytes(damaged)  # kept, byte for byte
    expected, archived = _expected(_outputs()), _archived(dsn)
    assert archived["windows"] == expected["windows"]
    assert len(expected["decisions"] - archived["decisions"]) == 1 and archived["decisions"] < expected["decisions"]


def test_a_cut_tail_is_reported_by_kind_and_its_bytes_kept(tmp_path):
    dsn, directory = _spooled(tmp_path)
    segment = _segment(directory)
    data = segment.read_bytes()
    cut = data[:-1000]
    torn = cut.rsplit(b"\n", 1)[-1]
    assert b'"k":"windows"' in torn  # the cut falls inside a windows entry (after it: smaller ones, gone whole)
    segment.write_bytes(cut)

    flushed = _flush(tmp_path, dsn)
    assert flushed.returncode == _EXIT_SET_ASIDE, flushed.stderr
    assert "1 spooled entries could not be delivered (1 windows)" in flushed.stderr
    kept = Path(str(segment) + ".bad")
    assert kept.read_bytes() == torn + b"\n"
    expected, archived = _expected(_outputs()), _archived(dsn)
    assert archived["decisions"] == expected["decisions"] and archived["windows"] < expected["windows"]


def test_a_second_flush_while_one_delivers_refuses_in_one_line(tmp_path):
    dsn, directory = _spooled(tmp_path)
    with open(directory / ".lock", "a+b") as held:  # a flush of another process, mid-delivery
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = _flush(tmp_path, dsn)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        f"specwatch archive flush: another process is delivering the archive spool {directory} now; nothing "
        "done, run it again once that one ends"]
    assert _segment(directory).exists()

    # two at once: each row delivered once, no raw archive error
    runs = [subprocess.Popen([*CLI, "archive", "flush", "--archive", dsn], env=_environ(tmp_path), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [(run.wait(600), *run.communicate()) for run in runs]
    assert sorted(code for code, _, _ in done) in ([0, 0], [0, 1]), done
    for code, out, err in done:
        assert "Traceback" not in err and "chdb" not in err.lower().replace(f"chdb://{tmp_path}", ""), err
        if code == 1:
            assert "another process is delivering the archive spool" in err
    assert sum("spooled entries delivered" in out for _, out, _ in done) == 1
    assert _archived(dsn) == _expected(_outputs())  # _contents checks each row is there once


def test_a_corrupt_telemetry_frame_keeps_the_rest_of_its_segment_aside(tmp_path):
    spool = TelemetrySpool(tmp_path / "telemetry", max_bytes=1 << 20)
    for i in range(6):
        assert spool.append(b"w1", b"record-%d " % i * 20, records=1)
    spool.close()
    (segment,) = sorted((tmp_path / "telemetry").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    frame = len(data) // 6
    data[3 * frame + frame // 2] ^= 0x01  # inside the fourth frame
    segment.write_bytes(bytes(data))

    reopened = TelemetrySpool(tmp_path / "telemetry", max_bytes=1 << 20)
    assert [f.payload for f in reopened.head(10)] == [b"record-%d " % i * 20 for i in range(3)]
    stats = reopened.stats()
    assert (stats.corrupt_frames, stats.set_aside_bytes, stats.pending_records) == (1, 3 * frame, 3)
    kept = Path(str(segment) + ".bad")
    assert kept.read_bytes() == bytes(data[3 * frame:])  # the bad frame and the two after it, byte for byte
    reopened.close()
