"""Archive outages on a real chDB archive made unwritable for real: rows spool to local disk, replay
when the archive is back, and every row is in the archive exactly once, partial writes included."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from specwatch.archive.store import Archive
from specwatch.archive.sink import ArchiveSink
from specwatch.archive.spool import Spool
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Decision, Policy
from specwatch.schemas.outputs import ActionRecord, SliceOutput

from machine import free_port
from telemetry_log import replayed
from test_archive import request
from test_samples import _sample_id

_POLICY = Policy.model_validate({"baseline": {"learn_seconds": 10}})


@lru_cache(maxsize=1)
def _outputs() -> tuple[SliceOutput, ...]:
    """90 s of the seeded demo fleet: 90 slices, a bundle at the start, a few with decisions."""
    records = Simulator("demo", seed=3, minutes=1.5, workers=2, concurrency=4, incident_at=20.0).records()
    outputs: list[SliceOutput] = []
    replayed(records, policy=_POLICY, sinks=[outputs.append])
    assert len([o for o in outputs if o.actions]) >= 3
    return tuple(outputs)


def _first_deciding() -> SliceOutput:
    return next(o for o in _outputs() if o.actions)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _unwritable(*roots: Path):
    """Nothing can be created in these directories (or below) until the block ends: the immutable
    flag as root (root ignores permission bits), permission bits otherwise."""
    directories = [Path(d) for root in roots for d, _, _ in os.walk(root)]  # walk does not follow symlinks
    as_root = os.geteuid() == 0
    if as_root:
        assert shutil.which("chattr"), "chattr (e2fsprogs) is needed to make a directory unwritable for root"
        # A background merge may remove its temporary directory between the walk and chattr:
        # that one is gone, and chattr still marks the others (an insert needs its table's).
        subprocess.run(["chattr", "+i", *map(str, directories)], stderr=subprocess.DEVNULL)
    else:
        modes = {d: d.stat().st_mode for d in directories}
        for d in directories:
            d.chmod(modes[d] & ~0o222)
    try:
        yield
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", *(str(d) for d in directories if d.exists())], check=True)
        else:
            for d, mode in modes.items():
                d.chmod(mode)


def _expected(outputs) -> dict:
    actions = [a for o in outputs for a in o.actions]
    samples = {(a.decision.id, s["kind"], _sample_id(s)) for a in actions for s in a.samples}
    windows = {(r["ts"], r["bundle_id"], r["bucket"], r["cohort"]) for o in outputs for r in o.window_rows}
    return {"decisions": {a.decision.id for a in actions}, "samples": samples, "windows": windows}


def _contents(archive: Archive) -> dict:
    _, decisions = archive.sql("SELECT decision_id, count() FROM specwatch.decisions FINAL GROUP BY decision_id")
    _, audits = archive.sql("SELECT audit_id, count() FROM specwatch.audit FINAL GROUP BY audit_id")
    _, samples = archive.sql("SELECT decision_id, kind, sample_id, count() FROM specwatch.samples FINAL "
                             "GROUP BY decision_id, kind, sample_id")
    _, windows = archive.sql("SELECT ts, bundle_id, bucket, cohort, count() FROM specwatch.window_stats FINAL "
                             "GROUP BY ts, bundle_id, bucket, cohort")
    for rows in (decisions, audits, samples, windows):
        assert all(row[-1] == 1 for row in rows)
    assert {row[0] for row in audits} == {f"a-{row[0]}" for row in decisions}
    return {"decisions": {row[0] for row in decisions}, "samples": {tuple(row[:3]) for row in samples},
            "windows": {tuple(row[:4]) for row in windows}}


def test_an_unwritable_chdb_archive_spools_and_every_row_arrives_exactly_once(tmp_path, caplog):
    outputs = _outputs()
    clock = _Clock()
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        sink = ArchiveSink(archive, window_batch=50, spool=tmp_path / "spool", clock=clock)
        for output in outputs[:40]:
            sink(output)
        assert sink.stats()["spooled"] == 0

        with caplog.at_level(logging.WARNING, logger="specwatch.archive.sink"), _unwritable(path):
            for output in outputs[40:60]:  # two decisions and their samples in here
                sink(output)
                clock.now += 1.0  # replays are tried, with backoff, and fail while it lasts
            sink.flush()
            stats = sink.stats()
            assert stats["archive_down"] and stats["outages"] == 1
            assert stats["spooled"] >= 3 and stats["dropped_entries"] == 0 and stats["failed_replays"] >= 1
            assert archive.decisions() == []  # nothing reached the archive meanwhile
        assert sum("not taking writes" in r.getMessage() for r in caplog.records) == 1

        clock.now += 120.0  # past any backoff: the next call replays
        for output in outputs[60:]:
            sink(output)
        sink.close()
        stats = sink.stats()
        assert not stats["archive_down"] and stats["spool_pending_bytes"] == 0
        assert stats["replayed"] == stats["spooled"] and stats["spool_corrupt"] == 0
        assert _contents(archive) == _expected(outputs)
        assert len(archive.bundles()) == 1
        assert not list((tmp_path / "spool").glob("spool-*"))  # replayed segments are gone


def test_a_replay_after_a_partial_write_duplicates_nothing(tmp_path):
    """The decisions table refuses while samples and audit still take the same decision's rows."""
    path = tmp_path / "archive"
    clock = _Clock()
    with Archive.open(f"chdb://{path}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool", clock=clock)
        decisions_table = (path / "data" / "specwatch" / "decisions").resolve()
        with _unwritable(decisions_table):
            sink(_first_deciding())
        assert sink.stats()["spooled"] == 1
        _, samples_before = archive.sql("SELECT count() FROM specwatch.samples")
        assert samples_before[0][0] > 0  # the partial write happened: samples, audit, no decision
        assert archive.decisions() == []
        clock.now += 120.0
        assert sink.retry()
        # Replay the same spooled entry once more, as a crash right after a replay would.
        sink(_first_deciding())
        sink.close()
        assert _contents(archive) == _expected([_first_deciding()])
        _, raw = archive.sql("SELECT count() FROM specwatch.samples")
        assert raw[0][0] > len(_expected([_first_deciding()])["samples"])  # physically there twice; FINAL reads once


def test_a_refusing_server_dsn_spools_until_an_archive_opens(tmp_path, caplog):
    closed = free_port()
    secret = "pw-" + os.urandom(8).hex()
    refusing = f"http://ops:{secret}@127.0.0.1:{closed}/specwatch"
    target = {"dsn": refusing}
    outputs = _outputs()
    clock = _Clock()
    with caplog.at_level(logging.DEBUG):
        sink = ArchiveSink(lambda: Archive.open(target["dsn"]), spool=tmp_path / "spool", clock=clock)
        for output in outputs[45:60]:
            sink(output)
            clock.now += 5.0
        sink.flush()
        stats = sink.stats()
        assert stats["archive_down"] and stats["spooled"] >= 2 and stats["written"] == 0
        target["dsn"] = f"chdb://{tmp_path / 'archive'}"  # the archive is back
        clock.now += 120.0
        for output in outputs[60:]:
            sink(output)
        sink.close()
    assert secret not in caplog.text
    assert sink.stats()["replayed"] == stats["spooled"]
    with Archive.open(target["dsn"]) as archive:
        assert _contents(archive) == _expected(outputs[45:])


def test_the_spool_outlives_the_process_and_replays_at_the_next_start(tmp_path):
    outputs = _outputs()
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        down = ArchiveSink(archive, spool=tmp_path / "spool", clock=_Clock())
        with _unwritable(path):
            for output in outputs[50:60]:
                down(output)
            down.close()  # gives up for now: the rows stay on disk
        assert down.stats()["spool_pending_bytes"] > 0 and archive.decisions() == []
        again = ArchiveSink(archive, spool=tmp_path / "spool")
        again.flush()
        assert again.stats()["replayed"] == down.stats()["spooled"]
        again.close()
        assert _contents(archive) == _expected(outputs[50:60])


def test_a_full_spool_drops_counts_and_says_so(tmp_path, caplog):
    spool = Spool(tmp_path / "spool", max_bytes=4096, fsync=False)
    sink = ArchiveSink(lambda: (_ for _ in ()).throw(ConnectionError("archive away")), spool=spool,
                       clock=_Clock())
    with caplog.at_level(logging.ERROR, logger="specwatch.archive.sink"):
        for output in _outputs()[50:70]:
            sink(output)
        sink.flush()
    stats = sink.stats()
    assert stats["dropped_entries"] > 0 and stats["spooled"] > 0
    assert spool.stats().refused_full == stats["dropped_entries"]
    assert spool.pending_bytes <= 4096
    assert sum("archive rows LOST" in r.getMessage() for r in caplog.records) == 1


def test_torn_writes_are_skipped_and_bad_segments_set_aside(tmp_path):
    spool = Spool(tmp_path / "spool", segment_bytes=200, fsync=False)
    for i in range(4):
        spool.append({"k": "windows", "rows": [{"i": i}]})
    spool.close()
    first, *_ = sorted((tmp_path / "spool").glob("spool-*"))
    with open(first, "ab") as segment:
        segment.write(b"0badc0de 99 {\"k\": \"windo")  # a crash mid-append
    seen: list = []
    again = Spool(tmp_path / "spool")
    assert again.replay(seen.extend) == 4
    assert [e["rows"][0]["i"] for e in seen] == [0, 1, 2, 3]
    (torn,) = again.set_aside_files()  # the torn bytes are kept beside their segment, not dropped
    assert torn.path == first.with_name(first.name + ".bad") and torn.path.read_bytes() == (
        b"0badc0de 99 {\"k\": \"windo\n") and again.stats().corrupt == 1

    bad = Spool(tmp_path / "bad", fsync=False)
    bad.append({"k": "mystery"})
    bad.append({"k": "windows", "rows": []})

    def refuse(entries):
        raise ValueError("not a row the archive takes")

    assert bad.replay(refuse) == 0
    assert bad.stats().quarantined == 1 and bad.empty
    assert [(kept.path.name, kept.kinds) for kept in bad.set_aside_files()] == [
        ("spool-000000000000.log.bad", {"mystery": 1, "windows": 1})]


def test_samples_never_reach_the_spool_or_the_archive_in_clear(tmp_path):
    prompt = "PROMPT-" + os.urandom(6).hex()
    sample = request(10.0, error=f"tokenizer rejected '{prompt}'")
    decision = Decision(ts=10.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
                        reason="error_rate", detector="error_gate", sample_ids=["r1"])
    output = SliceOutput(slice_index=10, slice_end=10.0, actions=[ActionRecord(decision, {"thresholds": {}}, [sample])])
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool", clock=_Clock())
        with _unwritable(path):
            sink(output)
        spooled = b"".join(p.read_bytes() for p in (tmp_path / "spool").glob("spool-*"))
        assert spooled and prompt.encode() not in spooled
        assert sink.retry()
        sink.close()
        archived = json.dumps(archive.samples(decision.id))
        assert prompt not in archived and "sha256:" in archived
    with Archive.open(f"chdb://{tmp_path / 'redacted'}", sample_text="redacted") as archive:
        archive.write_decision(decision, {}, [sample])
        (row,) = archive.samples(decision.id)
        assert row["record"]["error"] == "tokenizer rejected «…»"


def test_bad_rows_are_still_a_bug_not_an_outage(tmp_path):
    with Archive.open(f"chdb://{tmp_path / 'archive'}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool")
        with pytest.raises(ValueError):  # an empty bundle id: spooling it would only fail again later
            sink(SliceOutput(slice_index=1, slice_end=1.0,
                             bundles=[{"bundle_id": "", "card": {}, "ts": 1.0, "worker": "w"}]))
        assert sink.stats()["spooled"] == 0
        sink.close()
