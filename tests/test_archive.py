"""The archive on the real embedded ClickHouse engine (chDB): writes, reads, restarts (a second
process or archive at the same time runs in a subprocess: chDB hosts one directory per process)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from specwatch.archive.columns import TABLES, WINDOW_STATS, WINDOW_STATS_FIELDS
from specwatch.archive.errors import ArchiveError, ArchiveNotFoundError
from specwatch.archive.sink import ArchiveSink
from specwatch.archive.store import Archive
from specwatch.schemas import Decision
from specwatch.schemas.outputs import WINDOW_SUMMARY_FIELDS, SliceOutput, WindowRow
from specwatch.lab.simulation.simulator import DEFAULT_CARD

from machine import fresh_python, specwatch_ok


def stats_row(ts, bundle="b-1", bucket="coding", cohort="main", **changes):
    row = {name: [7, 3] if kind.startswith("Array") else 7 if kind == "UInt64" else 0.25
           for name, kind in WINDOW_STATS.columns}
    row.update(ts=float(ts), bundle_id=bundle, bucket=bucket, cohort=cohort, speculation_on=True,
               acceptance_length=2.5 + ts / 1000, speedup=1.4, tpot_p99=11.5)
    row.update(changes)
    return row


def window_row(row: dict) -> WindowRow:
    """A window-stats row dict as stage 2 hands it over (`SliceOutput.windows`)."""
    return WindowRow(*(row[name] for name in WindowRow._fields[:-1]),
                     tuple(row[name] for name in WINDOW_SUMMARY_FIELDS))


def decision(ts, bundle="b-1", bucket="coding", cohort=None, action="disable_speculation",
             reason="acceptance_drop", **evidence):
    return Decision(ts=ts, bundle_id=bundle, bucket=bucket, cohort=cohort, action=action, reason=reason,
                    detector="al_gate", evidence=evidence or {"acceptance_length": 1.2},
                    sample_ids=["r1", "w1:7"])


def request(ts, rid="r1", bundle="b-1", error=None):
    return {"kind": "request", "v": 1, "ts": ts, "worker": "w1", "bundle_id": bundle, "id": rid,
            "bucket": "coding", "cohort": "canary", "speculative": True, "ttft_ms": 95.0, "tpot_ms": None,
            "e2e_ms": 2950.0, "output_tokens": 1, "finish_reason": "error" if error else "stop",
            "error": error, "sample": {"prompt_sha256": "ab" * 32, "output_sha256": None,
                                       "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": 7,
                                                    "max_tokens": 256}}}


def step(ts, seq=7, bundle="b-1"):
    return {"kind": "step", "v": 1, "ts": ts, "worker": "w1", "seq": seq, "bundle_id": bundle,
            "draft_ms": 0.9, "verify_ms": 11.8, "kv_usage": 0.61,
            "requests": [{"id": "r1", "bucket": "coding", "cohort": "canary", "drafted": 4, "accepted": 3},
                         {"id": "r2", "bucket": "coding", "cohort": "canary", "drafted": 4, "accepted": 0}]}


def shadow(ts, rid="r1", bundle="b-1"):
    return {"kind": "shadow", "v": 1, "ts": ts, "bundle_id": bundle, "id": rid, "bucket": "coding",
            "check": "token_exact", "match": False}


CARD = DEFAULT_CARD.model_dump(mode="json")


def audit_for(window):
    return {"thresholds": {"acceptance_length_min": 1.8, "consecutive": 3},
            "baseline": {"acceptance_length": 2.8, "source": "pinned"},
            "window": window, "card": CARD}


def same(got, expected) -> bool:
    """Equal, NaN included (JSON writes every NaN alike, and NaN compares unequal to itself)."""
    return json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


@pytest.fixture
def archive(tmp_path):
    opened = Archive.open(f"chdb://{tmp_path}/archive")
    yield opened
    opened.close()


def test_everything_reads_back_exactly_from_a_new_process_after_restart(tmp_path):
    dsn = f"chdb://{tmp_path}/archive"
    window = [stats_row(100 + i, speedup=math.nan if i == 1 else 1.4, ttft_p99=None if i == 2 else 80.0)
              for i in range(4)]
    expected_window = [dict(row, ttft_p99=math.nan if row["ttft_p99"] is None else row["ttft_p99"])
                       for row in window]
    first = decision(103.5, acceptance_length=1.2, baseline=2.8, ratio=math.nan)
    second = decision(104.25, bucket=None, action="invalidate_bundle", reason="bundle_changed",
                      changed=["target.revision"])
    samples = [request(103.1), step(103.0), shadow(103.2), request(103.3, rid="r2", error="oom")]
    with Archive.open(dsn) as archive:
        archive.write_window_stats(window)
        archive.write_decision(first, audit_for(window), samples)
        archive.write_decision(second, {"thresholds": {}, "baseline": None, "window": [], "card": None,
                                        "changed": ["target.revision"]}, [])
        archive.write_bundle("b-1", CARD, 50.0, "w1")
        archive.write_bundle("b-1", CARD, 150.0, "w2")
        archive.write_override(("b-1", "chat", None), False, None, "alice", "canary looks off", 120.0)

    out = fresh_python("""
        import json, sys
        from specwatch.archive.store import Archive
        with Archive.open(sys.argv[1], create=False) as archive:
            ids = [d["decision_id"] for d in archive.decisions()]
            print(json.dumps({
                "decisions": archive.decisions(),
                "decision": archive.decision(ids[0]),
                "samples": archive.samples(ids[0]),
                "timeline": archive.timeline(bundle_id="b-1"),
                "bundles": archive.bundles(),
                "overrides": archive.overrides(),
                "flags": {"/".join(str(p) for p in scope): [s.enabled, s.reason, s.manual_by]
                          for scope, s in archive.flag_store().scopes().items()},
            }))
    """, dsn)
    got = json.loads(out)  # Python's json reads NaN back as float('nan')

    def decision_row(d):
        body = json.loads(d.to_json_line())
        return {"decision_id": d.id, "ts": d.ts, "bundle_id": d.bundle_id, "bucket": d.bucket,
                "cohort": d.cohort, "action": d.action, "reason": d.reason, "detector": d.detector,
                "evidence": body["evidence"], "sample_ids": d.sample_ids, "line": d.to_json_line()}

    assert got["decisions"] == [decision_row(first), decision_row(second)]
    assert got["decisions"][0]["evidence"]["ratio"] is None  # NaN has no JSON form
    one = got["decision"]
    audit = one.pop("audit")
    assert one == decision_row(first)
    expected_audit = dict(audit_for(expected_window), audit_id=f"a-{first.id}", kind="decision",
                          actor="specwatch", decision_id=first.id, scope="b-1/coding/*", reason="acceptance_drop")
    assert same({name: audit[name] for name in expected_audit}, expected_audit)

    assert [(s["kind"], s["sample_id"]) for s in got["samples"]] == [
        ("step", "w1:7"), ("request", "r1"), ("shadow", "r1"), ("request", "r2")]
    by_id = {(s["kind"], s["sample_id"]): s for s in got["samples"]}
    for key, sample in zip([("request", "r1"), ("step", "w1:7"), ("shadow", "r1")], samples):
        assert by_id[key]["record"] == sample
    assert by_id[("step", "w1:7")]["bucket"] == "coding" and by_id[("shadow", "r1")]["worker"] is None

    assert same(got["timeline"], expected_window)
    assert got["bundles"] == [{"bundle_id": "b-1", "card": CARD, "first_seen": 50.0, "last_seen": 150.0,
                               "workers": ["w1", "w2"],
                               "sightings": [{"worker": "w1", "first_seen": 50.0, "last_seen": 50.0},
                                             {"worker": "w2", "first_seen": 150.0, "last_seen": 150.0}]}]
    assert [(o["bucket"], o["enabled"], o["by"]) for o in got["overrides"]] == [("chat", False, "alice")]
    assert got["flags"] == {"b-1/coding/None": [False, "acceptance_drop", None],
                            "b-1/None/None": [False, "bundle_changed", None],
                            "b-1/chat/None": [False, "canary looks off", "alice"]}


def test_what_was_written_survives_a_killed_writer(tmp_path):
    dsn = f"chdb://{tmp_path}/archive"
    fresh_python("""
        import os, signal, sys
        from specwatch.archive.store import Archive
        from specwatch.schemas import Decision
        archive = Archive.open(sys.argv[1])
        archive.write_decision(Decision(ts=1.0, bundle_id="b-1", action="disable_speculation",
                                        reason="error_rate", detector="errors"), {}, [])
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush, a stale lock file left
    """, dsn, returncode=-9)
    out = fresh_python("""
        import sys
        from specwatch.archive.store import Archive
        with Archive.open(sys.argv[1], create=False) as archive:
            print([d["reason"] for d in archive.decisions()])
    """, dsn)
    assert out.strip() == "['error_rate']"


def test_open_without_create_refuses_a_missing_archive_and_leaves_no_trace(tmp_path):
    with pytest.raises(ArchiveNotFoundError, match="no archive at"):
        Archive.open(f"chdb://{tmp_path}/missing", create=False)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArchiveNotFoundError):
        Archive.open(f"chdb://{tmp_path}/empty", create=False)
    assert list((tmp_path / "empty").iterdir()) == []


def test_relative_chdb_dsn_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Archive.open("chdb://nested/dirs/archive") as archive:
        assert repr(archive) == f"Archive('chdb://{tmp_path}/nested/dirs/archive')"
        assert archive.exists()
    assert (tmp_path / "nested" / "dirs" / "archive" / "metadata").is_dir()


def test_same_decision_twice_is_one_decision_one_audit_row_and_one_set_of_samples(archive):
    d = decision(10.0)
    samples = [request(9.5), step(9.4), shadow(9.6)]
    archive.write_decision(d, audit_for([stats_row(9)]), samples)
    archive.write_decision(d, audit_for([stats_row(9)]), samples)
    archive.write_decisions([(d, audit_for([stats_row(9)]), samples)])
    assert [r["decision_id"] for r in archive.decisions()] == [d.id]
    assert len(archive.samples(d.id)) == 3
    assert len(archive.audit(kind="decision")) == 1
    _, rows = archive.sql(f"SELECT count() FROM specwatch.decisions FINAL WHERE decision_id = '{d.id}'")
    assert rows == [(1,)]


def test_rewriting_a_slice_replaces_it(archive):
    archive.write_window_stats([stats_row(1), stats_row(2)])
    archive.write_window_stats([stats_row(2, rounds=99)])
    archive.write_window_stats([stats_row(2, rounds=100), stats_row(1)])
    rows = archive.timeline(bundle_id="b-1")
    assert [(r["ts"], r["rounds"]) for r in rows] == [(1.0, 7), (2.0, 100)]


def test_timeline_is_in_slice_order_and_filters_by_scope_and_time(archive):
    rows = [stats_row(ts, bucket=bucket, cohort=cohort)
            for ts in (30, 10, 20) for bucket, cohort in (("coding", "main"), ("chat", "main"),
                                                          ("coding", "canary"), (None, None))]
    rows.append(stats_row(15, bundle="b-2"))
    archive.write_window_stats(rows[::2])
    archive.write_window_stats(rows[1::2])
    everything = archive.timeline()
    assert [r["ts"] for r in everything] == sorted(r["ts"] for r in everything)
    assert len(everything) == 13
    coding = archive.timeline(bundle_id="b-1", bucket="coding")
    assert [(r["ts"], r["cohort"]) for r in coding] == [
        (10.0, "canary"), (10.0, "main"), (20.0, "canary"), (20.0, "main"), (30.0, "canary"), (30.0, "main")]
    whole = archive.timeline(bundle_id="b-1", bucket="*")
    assert [(r["ts"], r["bucket"], r["cohort"]) for r in whole] == [(10.0, None, None), (20.0, None, None),
                                                                   (30.0, None, None)]
    window = archive.timeline(bundle_id="b-1", bucket="coding", cohort="main", since=20, until=30)
    assert [r["ts"] for r in window] == [20.0, 30.0]  # both ends inclusive


def test_nan_and_none_floats_are_stored_as_null_and_read_back_as_nan(archive):
    archive.write_window_stats([
        stats_row(1, speedup=math.nan, acceptance_length=None, kv_peak=float("inf")),
        stats_row(2),
    ])
    _, rows = archive.sql("SELECT ts, speedup IS NULL, acceptance_length IS NULL, isInfinite(kv_peak) "
                          "FROM specwatch.window_stats FINAL ORDER BY ts")
    assert rows == [(1.0, 1, 1, 1), (2.0, 0, 0, 0)]
    _, rows = archive.sql("SELECT avg(speedup) FROM specwatch.window_stats FINAL")  # NULLs are skipped
    assert rows == [(1.4,)]
    first, second = archive.timeline()
    assert math.isnan(first["speedup"]) and math.isnan(first["acceptance_length"])
    assert first["kv_peak"] == math.inf and second["speedup"] == 1.4
    assert isinstance(first["speculation_on"], bool) and isinstance(first["rounds"], int)


def test_decisions_filter_and_limit_to_the_most_recent_oldest_first(archive):
    made = [decision(float(ts), bucket=bucket, reason=reason, action=action)
            for ts, bucket, reason, action in [(1, "coding", "acceptance_drop", "reduce_draft_length"),
                                               (2, "chat", "latency_slo", "disable_speculation"),
                                               (3, None, "bundle_changed", "invalidate_bundle"),
                                               (4, "coding", "acceptance_drop", "disable_speculation"),
                                               (5, "coding", "acceptance_drop", "restore")]]
    archive.write_decisions((d, {}, []) for d in reversed(made))
    archive.write_decision(decision(6.0, bundle="b-2"), {}, [])
    ts = lambda rows: [r["ts"] for r in rows]  # noqa: E731
    assert ts(archive.decisions()) == [1, 2, 3, 4, 5, 6]
    assert ts(archive.decisions(bundle_id="b-1", bucket="coding")) == [1, 4, 5]
    assert ts(archive.decisions(bucket="*")) == [3]
    assert ts(archive.decisions(reason="acceptance_drop", action="disable_speculation")) == [4, 6]
    assert ts(archive.decisions(bundle_id="b-1", reason="acceptance_drop",
                                action="disable_speculation")) == [4]
    assert ts(archive.decisions(since=2, until=4)) == [2, 3, 4]
    assert ts(archive.decisions(limit=2)) == [5, 6]
    assert archive.decision("d-000000000000") is None
    assert archive.samples("d-000000000000") == []


def test_flag_store_folds_decisions_in_time_order_with_overrides_on_top(archive):
    archive.write_decisions([
        (decision(3.0, action="restore"), {}, []),
        (decision(1.0, action="disable_speculation"), {}, []),
        (decision(2.0, bucket="chat", action="reduce_draft_length", draft_length=2), {}, []),
        (decision(4.0, bucket="summarization"), {}, []),
    ])
    store = archive.flag_store()
    assert store.lookup("b-1", "coding", "main").enabled  # disabled at 1, restored at 3
    assert store.lookup("b-1", "chat", "main").draft_limit == 2
    assert not store.lookup("b-1", "summarization", "main").enabled
    archive.write_override(("b-1", "summarization", None), True, None, "carol", "false alarm", 5.0)
    archive.write_override(("b-1", "coding", "canary"), False, None, "carol", "hold canary", 6.0)
    store = archive.flag_store()
    assert store.lookup("b-1", "summarization", "main").enabled
    assert not store.lookup("b-1", "coding", "canary").enabled
    assert store.state(("b-1", "coding", "canary")).manual_by == "carol"
    archive.write_override(("b-1", "summarization", None), True, None, "carol", "done", 7.0, cleared=True)
    assert not archive.flag_store().lookup("b-1", "summarization", "main").enabled
    assert not archive.flag_store(overrides=False).lookup("b-1", "summarization", "main").enabled
    assert archive.flag_store(overrides=False).lookup("b-1", "coding", "canary").enabled


def test_overrides_keep_history_and_the_latest_event_per_scope_wins(archive):
    for _ in range(2):  # the same event twice is one event
        archive.write_override(("b-1", None, None), False, None, "dan", "incident", 10.0)
    archive.write_override(("b-1", "chat", None), True, 2, "dan", "shorter drafts", 11.0)
    archive.write_override(("b-1", None, None), False, None, "erin", "done", 12.0, cleared=True)
    archive.write_override(("b-1", None, None), True, 3, "erin", "again, shorter", 13.0)
    active = archive.overrides()
    assert [(o["bucket"], o["enabled"], o["draft_limit"], o["by"]) for o in active] == [
        ("chat", True, 2, "dan"), (None, True, 3, "erin")]
    history = archive.overrides(active_only=False)
    assert [o["ts"] for o in history] == [10.0, 11.0, 12.0, 13.0]
    assert [a["kind"] for a in archive.audit()] == ["override", "override", "override_clear", "override"]
    assert archive.audit()[2]["actor"] == "erin" and archive.audit()[2]["scope"] == "b-1/*/*"


def test_bundles_track_first_and_last_seen_and_workers(archive):
    archive.write_bundle("b-2", CARD, 40.0, "w3")
    archive.write_bundle("b-1", CARD, 30.0, "w1")
    archive.write_bundle("b-1", CARD, 90.0, "w2")
    archive.write_bundle("b-1", CARD, 60.0, "w1")
    archive.write_bundle("b-1", CARD, 60.0, "w1")  # the same sighting twice
    assert [(b["bundle_id"], b["first_seen"], b["last_seen"], b["workers"]) for b in archive.bundles()] == [
        ("b-1", 30.0, 90.0, ["w1", "w2"]), ("b-2", 40.0, 40.0, ["w3"])]


@pytest.mark.parametrize("statement", [
    "INSERT INTO specwatch.decisions (decision_id) VALUES ('x')",
    "DROP TABLE specwatch.decisions",
    "drop database specwatch",
    "ALTER TABLE specwatch.decisions DELETE WHERE 1",
    "TRUNCATE TABLE specwatch.window_stats",
    "SELECT 1; DROP TABLE specwatch.decisions",
    "SELECT * FROM specwatch.decisions INTO OUTFILE 'leak.csv'",
    "OPTIMIZE TABLE specwatch.decisions FINAL",
    "/* SELECT */ DROP TABLE specwatch.decisions",
    "",
])
def test_sql_refuses_anything_but_one_read_only_statement(archive, statement, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    archive.write_decision(decision(1.0), {}, [])
    with pytest.raises(ValueError):
        archive.sql(statement)
    assert len(archive.decisions()) == 1
    assert not (tmp_path / "leak.csv").exists()


def test_sql_runs_read_only_statements_and_the_engine_enforces_readonly(archive):
    archive.write_decision(decision(1.0), {}, [])
    assert archive.sql("SELECT count() AS n FROM specwatch.decisions FINAL;") == (["n"], [(1,)])
    assert archive.sql("WITH 2 AS x SELECT x * 2 AS y") == (["y"], [(4,)])
    assert archive.sql("-- where was it\nSELECT ';' AS s") == (["s"], [(";",)])
    names, rows = archive.sql("DESCRIBE TABLE specwatch.window_stats")
    assert [r[0] for r in rows] == list(WINDOW_STATS_FIELDS)
    with pytest.raises(ArchiveError, match="readonly"):
        archive.sql("SELECT 1 SETTINGS readonly = 0")
    with pytest.raises(ArchiveError, match="query failed"):
        archive.sql("SELECT no_such_column FROM specwatch.decisions")


@pytest.mark.parametrize("change, message", [
    ({"rounds": -1}, "row 1: 'rounds' is a count, not -1"),
    ({"accepted_tokens": 2.5}, "row 1: 'accepted_tokens' is a count, not 2.5"),
    ({"errors": None}, "row 1: 'errors' is a count, not None"),
    ({"ts": math.nan}, "row 1: 'ts' is a finite slice end time, not nan"),
    ({"bundle_id": None}, "row 1: 'bundle_id' is a bundle id string, not None"),
    ({"bucket": 3}, "row 1: 'bucket' is a string or None, not 3"),
    ({"speedup": "fast"}, "row 1: 'speedup' is a number or NaN, not 'fast'"),
    ({"speculation_on": 2}, "row 1: 'speculation_on' is a bool, not 2"),
    ({"speculation_on": None}, "row 1: 'speculation_on' is a bool, not None"),
    ({"steps": 1.5}, "row 1: 'steps' is a count, not 1.5"),
    ({"accepted_at_least": [3, -1]}, "row 1: 'accepted_at_least' is a list of counts, not [3, -1]"),
    ({"drafted_at_least": 4}, "row 1: 'drafted_at_least' is a list of counts, not 4"),
])
def test_bad_window_stats_are_refused_with_the_row_and_field(archive, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        archive.write_window_stats([stats_row(1), dict(stats_row(2), **change)])
    assert archive.timeline() == []


def test_window_stats_rows_must_be_complete_dicts(archive):
    incomplete = stats_row(2)
    del incomplete["kv_peak"]
    with pytest.raises(ValueError, match="row 1 lacks 'kv_peak'"):
        archive.write_window_stats([stats_row(1), incomplete])
    with pytest.raises(ValueError, match="row 0 is a tuple"):
        archive.write_window_stats([tuple(stats_row(1).values())])
    extra = dict(stats_row(3), merged_slices=12)  # unknown keys are ignored
    assert archive.write_window_stats([extra]) == 1


def test_a_bad_sample_writes_nothing_of_its_decision(archive):
    d = decision(1.0)
    with pytest.raises(ValueError, match="sample kind 'bundle'"):
        archive.write_decision(d, audit_for([]), [request(0.5), {"kind": "bundle", "ts": 0.1}])
    with pytest.raises(ValueError, match="step sample .* has no 'seq'"):
        archive.write_decision(d, audit_for([]), [{k: v for k, v in step(0.5).items() if k != "seq"}])
    with pytest.raises(TypeError):
        archive.write_decision(d.model_dump(), {}, [])
    assert archive.decisions() == [] and archive.samples(d.id) == [] and archive.audit() == []


def test_override_needs_who_and_a_sane_draft_limit(archive):
    with pytest.raises(ValueError, match="by"):
        archive.write_override(("b-1", None, None), False, None, "", "why", 1.0)
    with pytest.raises(ValueError, match="draft_limit"):
        archive.write_override(("b-1", None, None), True, 0, "amy", "why", 1.0)
    with pytest.raises(ValueError, match="finite"):
        archive.write_override(("b-1", None, None), True, None, "amy", "why", math.inf)


def test_one_chdb_archive_per_process_and_shared_clients_per_path(tmp_path):
    first = Archive.open(f"chdb://{tmp_path}/one")
    again = Archive.open(f"chdb://{tmp_path}/one/")  # same directory, other spelling
    try:
        with pytest.raises(ArchiveError, match="one archive per process"):
            Archive.open(f"chdb://{tmp_path}/two")
        first.write_decision(decision(1.0), {}, [])
        first.close()
        assert len(again.decisions()) == 1  # still open: the engine is shared and counted
    finally:
        first.close()
        again.close()
    with Archive.open(f"chdb://{tmp_path}/two") as other:  # released with the last user
        assert other.decisions() == []


def test_window_stats_reach_the_archive_directly_and_through_the_sink_in_slice_sized_writes(archive, tmp_path):
    rows = [stats_row(i, bucket=("coding", "chat", "summarization")[i % 3], cohort=("main", "canary")[i % 2],
                      speedup=math.nan if i % 7 == 0 else 1.3)
            for i in range(70_000)]  # more than one insert chunk
    assert archive.write_window_stats(rows) == 70_000
    sink = ArchiveSink(archive, window_batch=20_000, spool=tmp_path / "spool")
    for i in range(0, len(rows), 50):
        sink(SliceOutput(slice_index=i, slice_end=float(i),
                         windows=[window_row(dict(r, ts=r["ts"] + 100_000)) for r in rows[i:i + 50]]))
    sink.close()
    assert sink.stats()["written"] == 4 and sink.stats()["spooled"] == 0  # 3 full batches and the rest
    _, counted = archive.sql("SELECT count(), countIf(speedup IS NULL) FROM specwatch.window_stats FINAL")
    assert counted == [(140_000, 2 * 10_000)]


def test_the_tables_are_created_exactly_as_pinned(archive):
    """Columns, types, defaults, engine settings and insert columns, as in archive_schema.txt."""
    archive.ensure_schema()
    archive.ensure_schema()
    _, engines = archive.sql("SELECT name, engine_full FROM system.tables WHERE database = 'specwatch'")
    _, columns = archive.sql("SELECT table, name, type, default_kind, default_expression FROM system.columns "
                             "WHERE database = 'specwatch' ORDER BY table, position")
    engines = dict(engines)
    created = [f"{table.name}: " + ", ".join(f"{name} {kind}" + (f" {default} {expression}" if default else "")
                                             for where, name, kind, default, expression in columns
                                             if where == table.name) + f" | {engines.pop(table.name)}"
               for table in TABLES]
    assert engines == {}  # no table the spec does not name
    inserts = [f"insert {t.name}: " + " ".join(f"{f.name}:{f.type}" for f in t.insert_schema)
               for t in TABLES]
    pinned = (Path(__file__).parent / "archive_schema.txt").read_text().splitlines()
    assert created + inserts == pinned


def test_an_archive_from_before_the_position_columns_gains_them_on_open(tmp_path):
    dsn = f"chdb://{tmp_path / 'old'}"
    with Archive.open(dsn) as archive:
        for name in ("steps", "plain_entries", "accepted_at_least", "drafted_at_least"):
            archive._client.command(f"ALTER TABLE specwatch.window_stats DROP COLUMN {name}")
        _, described = archive.sql("DESCRIBE TABLE specwatch.window_stats")
        assert "drafted_at_least" not in [r[0] for r in described]
        old_row = {k: v for k, v in stats_row(1).items() if k not in ("steps", "plain_entries", "accepted_at_least",
                                                                      "drafted_at_least")}
        archive._client.insert("specwatch.window_stats", [list(old_row.values())], column_names=list(old_row))
    with Archive.open(dsn, create=False) as archive:  # read-only: the old rows read with empty counts
        [row] = archive.timeline()
        assert (row["steps"], row["accepted_at_least"], row["rounds"]) == (0, [], 7)
    with Archive.open(dsn) as archive:
        archive.write_window_stats([stats_row(1, accepted_at_least=[9, 5, 2], drafted_at_least=[10, 10, 10])])
        [row] = archive.timeline()
        assert (row["steps"], row["accepted_at_least"], row["drafted_at_least"]) == (7, [9, 5, 2], [10, 10, 10])


def test_the_bench_measures_the_sink_beside_direct_writes_and_single_row_inserts():
    """The bench checks itself that every path's rows reached the table."""
    done = specwatch_ok("bench", "--section", "archive", "--smoke", "--json", timeout=900)
    report = json.loads(done.stdout)["archive"]
    assert (report["rows"], report["naive_rows"]) == (20_000, 50)
    assert 0 < report["slices"] < report["rows"]
    assert report["sink_over_direct"] == report["sink_rows_per_s"] / report["direct_rows_per_s"]
    assert report["speedup_vs_naive"] == report["sink_rows_per_s"] / report["naive_rows_per_s"]
    assert report["sink_over_row_path"] == report["sink_rows_per_s"] / report["row_path_rows_per_s"]
    # the sink against the path it replaced, stage 2's row building included
    assert report["sink_over_sink_rows_with_stage2_cpu"] == (report["sink_rows_per_s_cpu"]
                                                             / report["sink_rows_with_stage2_rows_per_s_cpu"])
    assert report["insert_rows"] == 20_000 and report["rows_per_slice"] == 20_000 / report["slices"]
    assert {f"insert_{transport}_rows_per_s" for transport in ("memory", "stream", "file")} <= set(report)
    # the build from the statistics split into its parts: the percentiles and the Arrow table alone
    assert {f"build_{part}_rows_per_s" for part in ("stats", "percentiles", "table")} <= set(report)
    assert 0 < report["sketches_per_row"] <= 3
