"""`specwatch replay` and `demo` with an archive they cannot really write: the decisions still come
out, one warning line says where the archive rows wait, and a later run delivers them once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import pytest

from test_archive_outage import _contents, _unwritable

from specwatch.archive.errors import ArchiveError
from specwatch.archive.sink import ArchiveSink, spool_dir_for
from specwatch.archive.store import Archive
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas.codec import encode_record

from machine import free_port, specwatch

_POLICY_TOML = "[baseline]\nlearn_seconds = 10\n"


@lru_cache(maxsize=1)
def _telemetry() -> str:
    """90 s of the seeded demo fleet, 2 workers, an incident at 20 s: three decisions with this policy."""
    records = Simulator("demo", seed=3, minutes=1.5, workers=2, concurrency=4, incident_at=20.0).records()
    return "".join(encode_record(record) + "\n" for record in records)


def _specwatch(tmp_path: Path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECWATCH_ARCHIVE_SPOOL=str(tmp_path / "spool"), **environ)
    env.pop("SPECWATCH_ARCHIVE", None)
    return specwatch(*argv, env=env, cwd=tmp_path, timeout=600)


def _replay(tmp_path: Path, dsn: str | None, output: str, **environ) -> subprocess.CompletedProcess:
    telemetry, policy = tmp_path / "telemetry.jsonl", tmp_path / "policy.toml"
    if not telemetry.exists():
        telemetry.write_text(_telemetry())
        policy.write_text(_POLICY_TOML)
    archive = ["--archive", dsn] if dsn else []
    return _specwatch(tmp_path, "replay", str(telemetry), "--output", str(tmp_path / output), "--policy",
                      str(policy), *archive, **environ)


def _expected(tmp_path: Path) -> list[str]:
    """The decisions of the same replay without an archive."""
    done = _replay(tmp_path, None, "expected.jsonl")
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "expected.jsonl").read_text().splitlines()
    assert len(lines) == 3
    return lines


def _replayed_despite(tmp_path: Path, dsn: str, expected: list[str]) -> str:
    """A replay with the archive at ``dsn`` out of reach: exit 0, every decision written, one warning (returned)."""
    done = _replay(tmp_path, dsn, "decisions.jsonl")
    assert done.returncode == 0
    assert (tmp_path / "decisions.jsonl").read_text().splitlines() == expected
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("specwatch replay: warning: ") and "Traceback" not in done.stderr
    return lines[0]


def _archived_once(dsn: str) -> list[str]:
    """The archived decision lines in time order; every decision, audit, sample, window row once."""
    with Archive.open(dsn, create=False) as archive:
        contents = _contents(archive)
        _, lines = archive.sql("SELECT line FROM specwatch.decisions FINAL ORDER BY ts, decision_id")
    assert contents["samples"] and contents["windows"]
    return [row[0] for row in lines]


def _spool_of(tmp_path: Path, dsn: str) -> Path:
    return spool_dir_for(dsn, {"SPECWATCH_ARCHIVE_SPOOL": str(tmp_path / "spool")})


def _spooled(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "spool").glob("*/spool-*.log"))


@contextlib.contextmanager
def _held_by_another_process(dsn: str) -> Iterator[int]:
    """The archive at ``dsn`` open in another process for the time of the block; yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom specwatch.archive.store import Archive\n"
         f"archive = Archive.open({dsn!r})\nprint('holding', flush=True)\nsys.stdin.read()\narchive.close()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        yield holder.pid
    finally:
        holder.communicate("", timeout=60)


def test_a_chdb_archive_held_by_another_process_costs_no_decision(tmp_path):
    expected = _expected(tmp_path)
    path = tmp_path / "archive"
    dsn = f"chdb://{path}"
    Archive.open(dsn).close()
    with _held_by_another_process(dsn) as holder:
        warning = _replayed_despite(tmp_path, dsn, expected)
    assert f"(the chDB archive at {path} is in use by process {holder}: " in warning
    assert f" bytes of archive rows wait in the spool {_spool_of(tmp_path, dsn)} and go to " in warning
    assert _spooled(tmp_path)

    # The holder is gone: the next run delivers the spool by itself, and its own rows, once each.
    waiting = sum(len(segment.read_bytes().splitlines()) for segment in _spooled(tmp_path))
    again = _replay(tmp_path, dsn, "again.jsonl")
    assert again.returncode == 0
    assert again.stderr == (f"specwatch replay: {waiting} spooled entries from an earlier run were delivered "
                            f"to the archive {dsn}\n")
    assert (tmp_path / "again.jsonl").read_text().splitlines() == expected
    assert not _spooled(tmp_path)
    assert _archived_once(dsn) == expected


def test_a_read_only_chdb_directory_costs_no_decision_and_flush_delivers_later(tmp_path):
    expected = _expected(tmp_path)
    path = tmp_path / "archive"
    dsn = f"chdb://{path}"
    Archive.open(dsn).close()
    with _unwritable(path):
        assert str(tmp_path / "spool") in _replayed_despite(tmp_path, dsn, expected)
    with Archive.open(dsn, create=False) as archive:
        assert archive.decisions() == []
    assert _spooled(tmp_path)

    flushed = _specwatch(tmp_path, "archive", "flush", "--archive", dsn)
    assert flushed.returncode == 0, flushed.stderr
    assert flushed.stdout.endswith("spooled entries delivered to the archive\n")
    assert not _spooled(tmp_path)
    assert _archived_once(dsn) == expected
    # Delivered again (a crash right after a delivery would do that): still once each.
    nothing = _specwatch(tmp_path, "archive", "flush", "--archive", dsn)
    assert nothing.returncode == 0 and nothing.stdout.startswith("nothing spooled in ")
    assert _archived_once(dsn) == expected


def test_an_http_archive_nobody_listens_on_costs_no_decision(tmp_path):
    expected = _expected(tmp_path)
    port = free_port()
    dsn = f"http://127.0.0.1:{port}/specwatch"
    warning = _replayed_despite(tmp_path, dsn, expected)
    assert warning.startswith(f"specwatch replay: warning: the archive was unreachable (cannot connect to the "
                              f"archive at {dsn}: [Errno 111] Connection refused); ")
    assert warning.endswith(f" bytes of archive rows wait in the spool {_spool_of(tmp_path, dsn)} and go to the "
                            "archive at the next run that reaches it, or with "
                            f"`specwatch archive flush --archive {dsn}`")
    segments = _spooled(tmp_path)
    assert len(segments) == 1
    # What waits is every decision, with its samples redacted as the archive would keep them.
    spooled = [json.loads(line.split(b" ", 2)[2]) for line in segments[0].read_bytes().splitlines()]
    assert [e["line"] for e in spooled if e["k"] == "decision"] == expected

    still = _specwatch(tmp_path, "archive", "flush", "--archive", dsn)
    assert still.returncode == 1 and len(still.stderr.strip().splitlines()) == 1
    assert _spooled(tmp_path) == segments


def test_demo_with_an_unreachable_archive_still_reports_every_decision(tmp_path):
    port = free_port()
    dsn = f"http://127.0.0.1:{port}/specwatch"
    fleet = ("demo", "--json", "--scenario", "acceptance_drop", "--minutes", "5", "--workers", "2")
    reached = _specwatch(tmp_path, *fleet, "--no-archive", "--outdir", str(tmp_path / "a"))
    away = _specwatch(tmp_path, *fleet, "--archive", dsn, "--outdir", str(tmp_path / "b"))
    assert reached.returncode == 0 and away.returncode == 0, away.stderr
    summary, expected = json.loads(away.stdout.splitlines()[-1]), json.loads(reached.stdout.splitlines()[-1])
    assert len(expected["decision_ids"]) == 3 and summary["decision_ids"] == expected["decision_ids"]
    assert summary["archive"] is None  # not in the archive yet: the warning says where the rows are
    warnings = [line for line in away.stderr.splitlines() if "warning" in line or "Traceback" in line]
    assert len(warnings) == 1 and warnings[0].startswith("specwatch demo: warning: ")
    assert len(_spooled(tmp_path)) == 1


def test_a_worker_sink_refuses_a_held_archive_at_start_and_closes_the_archive_it_opened(tmp_path):
    """`specwatch run` opens its sink the way the one-shot commands do, but needs the archive at start:
    a chDB directory held by another process fails then, naming the holder, and nothing is spooled."""
    dsn = f"chdb://{tmp_path / 'archive'}"
    Archive.open(dsn).close()
    with _held_by_another_process(dsn) as holder:
        in_use = f"is in use by process {holder}: a chDB directory opens in one process at a time"
        with pytest.raises(ArchiveError, match=in_use):
            ArchiveSink.open(dsn, spool=tmp_path / "spool", require_archive=True)
    assert not (tmp_path / "spool").exists()
    sink = ArchiveSink.open(dsn, spool=tmp_path / "spool", require_archive=True)
    assert sink.archive.label == f"chdb://{tmp_path / 'archive'}" and not sink.stats()["archive_down"]
    sink.close()
    assert sink.archive is None
    Archive.open(f"chdb://{tmp_path / 'other'}").close()  # the engine was released: another path opens here


def test_an_unknown_sample_text_mode_is_refused_at_start_not_taken_for_an_outage(tmp_path):
    """A setting the archive would refuse on every open is never taken for the archive away."""
    done = _replay(tmp_path, f"chdb://{tmp_path / 'archive'}", "decisions.jsonl",
                   SPECWATCH_ARCHIVE_SAMPLE_TEXT="clear")
    assert done.returncode == 2
    assert done.stderr == ("specwatch replay: SPECWATCH_ARCHIVE_SAMPLE_TEXT must be one of hashes, redacted, "
                           "got 'clear'\n")
    assert not (tmp_path / "spool").exists() and not (tmp_path / "decisions.jsonl").exists()
