"""`specwatch query` and `specwatch flags` against a real chDB archive.

Query commands run in-process through `specwatch.cli.main`; flag changes run as real
`specwatch` processes, as an operator would, and are checked in the audit trail.
"""

from __future__ import annotations

import json
import math

import pytest

from specwatch.archive.columns import WINDOW_STATS_FIELDS
from specwatch.archive.store import Archive
from specwatch.cli import main
from specwatch.schemas import Decision

from machine import run_cli, specwatch, specwatch_ok

_T0 = 1_717_000_000.0
_COUNTS = {"rounds", "drafted_tokens", "accepted_tokens", "requests", "errors", "shadow_checks",
           "shadow_mismatches", "steps", "plain_entries"}
_POSITIONS = {"accepted_at_least", "drafted_at_least"}
CARD = {"target": {"model_id": "llama-8b", "revision": "r2", "tokenizer_digest": "t1", "quantization": "fp8"},
        "drafter": {"mechanism": "eagle3", "revision": "e1", "draft_length": 4},
        "runtime": {"engine": "vllm-0.32", "gpu": "L4", "parallelism": "tp1"},
        "policy": {"acceptance_rule": "strict", "fallback": "standard"}}


def slice_row(i, bucket="coding", cohort="main", bundle="b-1"):
    row = {name: ([10, 4] if name in _POSITIONS else 10 if name in _COUNTS else 1.0) for name in WINDOW_STATS_FIELDS}
    dropped = i >= 12
    row.update(ts=_T0 + 10 * i, bundle_id=bundle, bucket=bucket, cohort=cohort, rounds=100 + i,
               acceptance_length=1.3 if dropped else 3.1, speedup=0.9 if dropped else 1.6,
               draft_overhead=0.12, tpot_p99=14.0 if dropped else 9.0, e2e_p99=3100.0,
               ttft_p99=math.nan if i == 3 else 120.0, speculation_on=i < 15, errors=0, error_rate=0.0)
    return row


DROP = Decision(ts=_T0 + 145.0, bundle_id="b-1", bucket="coding", cohort=None, action="disable_speculation",
                reason="acceptance_drop", detector="al_gate",
                evidence={"acceptance_length": 1.3, "baseline": 3.1, "consecutive": 3},
                sample_ids=["r7", "w1:42"])
SLO = Decision(ts=_T0 + 60.0, bundle_id="b-1", bucket="chat", cohort="canary", action="disable_speculation",
               reason="latency_slo", detector="p99_gate", evidence={"tpot_p99": 40.0, "slo": 30.0})
OTHER = Decision(ts=_T0 + 30.0, bundle_id="b-2", bucket=None, cohort=None, action="invalidate_bundle",
                 reason="bundle_changed", detector="card", evidence={"changed": ["target.revision"]})
SAMPLES = [
    {"kind": "request", "v": 1, "ts": _T0 + 144.0, "worker": "w1", "bundle_id": "b-1", "id": "r7",
     "bucket": "coding", "cohort": "main", "speculative": True, "ttft_ms": 120.0, "tpot_ms": 14.2,
     "e2e_ms": 3050.0, "output_tokens": 200, "finish_reason": "stop", "error": None},
    {"kind": "step", "v": 1, "ts": _T0 + 143.5, "worker": "w1", "seq": 42, "bundle_id": "b-1", "draft_ms": 1.1,
     "verify_ms": 11.0, "kv_usage": 0.4,
     "requests": [{"id": "r7", "bucket": "coding", "cohort": "main", "drafted": 4, "accepted": 0}]},
]


@pytest.fixture
def dsn(tmp_path):
    """An archive as the pipeline leaves it: slices, decisions with evidence, bundles."""
    dsn = f"chdb://{tmp_path}/archive"
    with Archive.open(dsn) as archive:
        archive.write_window_stats([slice_row(i, bucket) for bucket in ("coding", "chat") for i in range(20)])
        window = [slice_row(i) for i in range(10, 15)]
        archive.write_decision(DROP, {"thresholds": {"acceptance_length_min": 2.0},
                                      "baseline": {"acceptance_length": 3.1}, "window": window, "card": CARD},
                               SAMPLES)
        archive.write_decision(SLO, {"thresholds": {"tpot_p99_ms": 30.0}, "baseline": None, "window": [],
                                     "card": CARD}, [])
        archive.write_decision(OTHER, {}, [])
        archive.write_bundle("b-1", CARD, _T0, "w1")
        archive.write_bundle("b-1", CARD, _T0 + 190, "w2")
    return dsn


@pytest.fixture
def query(capsys, dsn):
    """``specwatch query ARGV... --archive DSN`` in this process: exit code, stdout, stderr."""
    return lambda *argv: run_cli(capsys, "query", *argv, "--archive", dsn)


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_decisions_as_table_and_json_lines_with_filters(query):
    code, out, _ = query("decisions")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["time", "(UTC)", "decision"]
    assert [line.split()[2] for line in lines[1:]] == [OTHER.id, SLO.id, DROP.id]
    assert "2024-05-29 16:29:05.000" in out and "acceptance_drop" in out

    code, out, _ = query("decisions", "--json", "--bundle", "b-1", "--reason", "acceptance_drop")
    assert code == 0
    [row] = json_lines(out)
    assert row["decision_id"] == DROP.id and row["evidence"] == DROP.evidence
    assert row["line"] == DROP.to_json_line()

    _, out, _ = query("decisions", "--json", "--bucket", "*")
    assert [r["decision_id"] for r in json_lines(out)] == [OTHER.id]
    _, out, _ = query("decisions", "--json", "--since", "2024-05-29T16:27:20Z", "--until", str(_T0 + 100))
    assert [r["decision_id"] for r in json_lines(out)] == [SLO.id]


def test_decision_shows_its_audit_evidence(query):
    code, out, _ = query("decision", DROP.id)
    assert code == 0
    assert f"decision  {DROP.id}" in out and "scope b-1/coding/*" in out
    assert "acceptance_length=1.3 baseline=3.1 consecutive=3" in out
    assert "thresholds  acceptance_length_min=2" in out
    assert "5 slices" in out and "AL 3.10 -> 1.30" in out
    assert "target llama-8b@r2 fp8; drafter eagle3@e1 D=4" in out
    assert "2 (1 request, 1 step)" in out

    code, out, _ = query("decision", DROP.id, "--json")
    [row] = json_lines(out)
    assert row["audit"]["card"] == CARD and len(row["audit"]["window"]) == 5
    assert row["audit"]["window"][0]["ttft_p99"] == 120.0
    assert row["sample_counts"] == {"request": 1, "step": 1}


def test_samples_are_the_records_kept(query):
    code, out, _ = query("samples", DROP.id, "--json")
    assert code == 0
    rows = json_lines(out)
    assert [r["record"] for r in rows] == [SAMPLES[1], SAMPLES[0]]  # time order
    assert [r["sample_id"] for r in rows] == ["w1:42", "r7"]
    code, out, _ = query("samples", DROP.id)
    assert "1 requests drafted=4 accepted=0" in out and "stop spec ttft=120ms tpot=14.2ms" in out


def test_timeline_around_a_decision_marks_the_tipping_slice(query):
    code, out, _ = query("timeline", "--around", DROP.id, "--seconds", "30", "--json")
    assert code == 0
    rows = json_lines(out)
    assert [r["ts"] - _T0 for r in rows] == [120.0, 130.0, 140.0, 150.0, 160.0, 170.0]
    assert {r["bucket"] for r in rows} == {"coding"}  # the decision's bucket
    assert [r["mark"] for r in rows] == ["", "", "", "<", "", ""]

    code, out, _ = query("timeline", "--around", DROP.id)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["slice", "end", "(UTC)", "bucket", "cohort"]
    assert "AL" in lines[0] and "speedup" in lines[0] and "tpot p99" in lines[0]
    assert len(lines) == 1 + 17 + 1 and lines[-1].startswith("(< marks")  # slices within 120 s either side
    tipping = next(line for line in lines if line.endswith("<"))
    assert "1.30" in tipping and "0.90" in tipping and " off " in tipping

    code, out, _ = query("timeline", "--bundle", "b-1", "--bucket", "chat", "--json", "--since", str(_T0 + 20),
                         "--until", str(_T0 + 40))
    rows = json_lines(out)
    assert [(r["bucket"], r["ts"] - _T0) for r in rows] == [("chat", 20.0), ("chat", 30.0), ("chat", 40.0)]
    assert rows[1]["ttft_p99"] is None  # NaN becomes null in JSON Lines

    code, _, err = query("timeline")
    assert code == 2 and "--bundle" in err


def test_bundles(query):
    code, out, _ = query("bundles", "--json")
    assert code == 0
    assert json_lines(out) == [{"bundle_id": "b-1", "card": CARD, "first_seen": _T0, "last_seen": _T0 + 190,
                                "workers": ["w1", "w2"],
                                "sightings": [{"worker": "w1", "first_seen": _T0, "last_seen": _T0},
                                              {"worker": "w2", "first_seen": _T0 + 190, "last_seen": _T0 + 190}]}]
    code, out, _ = query("bundles")
    assert "b-1" in out and "eagle3@e1 D=4" in out


_REFUSED = "specwatch query: refused: "
_STOPPED = "specwatch query: query stopped: "
_SQL = [  # (arguments, exit code, stdout, the start of stderr)
    (["SELECT reason, count() AS n FROM specwatch.decisions FINAL GROUP BY reason ORDER BY reason",
      "--json"], 0, '{"reason":"acceptance_drop","n":1}\n{"reason":"bundle_changed","n":1}\n'
                    '{"reason":"latency_slo","n":1}\n', ""),
    (["INSERT INTO specwatch.decisions (decision_id) VALUES ('x')"], 2, "", _REFUSED),
    (["DROP TABLE specwatch.decisions"], 2, "", _REFUSED),
    (["SELECT 1; DROP TABLE specwatch.decisions"], 2, "", _REFUSED),
    (["SELECT nope FROM specwatch.decisions"], 1, "", "specwatch query: query failed"),
    (["SELECT count() AS n FROM specwatch.decisions FINAL"], 0, "n\n3\n", ""),
    # names resolve in the archive's database; no rows is said, in JSON Lines no lines
    (["SELECT count() AS n FROM decisions FINAL"], 0, "n\n3\n", ""),
    (["SELECT * FROM decisions WHERE reason = 'none'"], 0, "0 rows\n", ""),
    (["SELECT * FROM decisions WHERE reason = 'none'", "--json"], 0, "", ""),
    (["SELECT count() FROM system.numbers", "--max-seconds", "0.5"], 1, "",
     f"{_STOPPED}it ran longer than 0.5 s (max_execution_time); narrow the statement or raise "
     "--max-seconds\n"),
    (["SELECT number FROM system.numbers LIMIT 11", "--max-rows", "10"], 1, "",
     f"{_STOPPED}it returns more than 10 rows (max_result_rows); narrow the statement or raise "
     "--max-rows\n"),
    (["SELECT number FROM system.numbers LIMIT 10", "--max-rows", "10", "--json"], 0,
     "".join(f'{{"number":{n}}}\n' for n in range(10)), ""),
    (["SELECT 1", "--max-rows", "0"], 2, "", f"{_REFUSED}max_rows must be a positive whole number"),
]


def test_sql_reads_refuses_writes_and_stops_at_its_limits(query):
    for argv, code, out, err in _SQL:
        got = query("sql", *argv)
        assert got[:2] == (code, out) and got[2].startswith(err), (argv, got)
    code, out, _ = query("sql", "SHOW TABLES")
    assert code == 0
    assert out.split()[0] == "name" and {"decisions", "samples", "window_stats", "bundles"} <= set(out.split())


@pytest.mark.parametrize("argv", [["decision", "d-nope"], ["samples", "d-nope"], ["timeline", "--around", "d-nope"],
                                  ["samples", "d-nope", "--json"]])
def test_an_unknown_decision_id_is_one_line_and_exit_1(query, argv):
    code, out, err = query(*argv)
    assert (code, out, err) == (1, "", "specwatch query: no decision 'd-nope' in the archive\n")


def test_unknown_bundles_and_empty_results_say_so(query, capsys, tmp_path):
    code, out, err = query("timeline", "--bundle", "b-nope")
    assert (code, out, err) == (1, "", "specwatch query: no bundle 'b-nope' in the archive\n")
    code, out, _ = query("timeline", "--bundle", "b-2")  # decided on, no slices
    assert (code, out) == (0, "0 rows\n")
    code, out, _ = query("samples", SLO.id)  # a decision with no samples
    assert (code, out) == (0, f"no samples archived with decision {SLO.id}\n")
    code, out, _ = query("decisions", "--reason", "kv_pressure")
    assert (code, out) == (0, "0 rows\n")

    empty = f"chdb://{tmp_path}/empty"
    Archive.open(empty).close()
    for argv, said in ((["query", "decisions"], "0 rows\n"), (["query", "bundles"], "no bundle in the archive yet\n"),
                       (["bundles", "list"], "no bundle in the archive yet\n"),
                       (["flags", "list"], "speculation on everywhere: no decision or override in force\n"),
                       (["query", "decisions", "--json"], ""), (["bundles", "list", "--json"], ""),
                       (["flags", "list", "--json"], "")):
        code, out, err = run_cli(capsys, *argv, "--archive", empty)
        assert (code, out, err) == (0, said, "")


def test_explain_says_in_one_line_when_the_decision_is_missing(capsys, dsn):
    code, out, err = run_cli(capsys, "explain", "d-nope", "--archive", dsn)
    assert (code, out) == (1, "") and err.startswith("specwatch explain: no decision 'd-nope' in the archive")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ["query", "decisions"], ["query", "decision", "d-1"], ["query", "samples", "d-1"],
    ["query", "timeline", "--bundle", "b-1"], ["query", "bundles"], ["query", "sql", "SELECT 1"],
    ["explain", "d-nope"], ["flags", "list"],
    ["flags", "set", "--bundle", "b-1", "--off", "--by", "al", "--reason", "x"]])
def test_a_missing_archive_is_one_clear_line_and_is_not_created(capsys, tmp_path, argv):
    code, out, err = run_cli(capsys, *argv, "--archive", f"chdb://{tmp_path}/nothing")
    assert (code, out, len(err.splitlines())) == (2, "", 1)
    assert err.startswith(f"specwatch {argv[0]}: no archive at chdb://{tmp_path}/nothing")
    assert not (tmp_path / "nothing").exists()


def test_flags_set_list_clear_through_the_cli_with_audit_rows(dsn):
    listed = specwatch_ok("flags", "list", "--json", "--archive", dsn)
    before = {(r["bundle_id"], r["bucket"], r["cohort"]): r for r in json_lines(listed.stdout)}
    assert {tuple(r) for r in before.values()} == {(  # the table's made-up columns stay out of JSON
        "bundle_id", "bucket", "cohort", "speculation", "draft_limit", "cohort_share", "reason", "since", "manual",
        "by", "decision_id", "automatic")}
    assert before[("b-1", "coding", None)]["speculation"] == "off"
    assert before[("b-1", "coding", None)]["decision_id"] == DROP.id
    assert before[("b-2", None, None)]["reason"] == "bundle_changed"

    done = specwatch_ok("flags", "set", "--bundle", "b-1", "--bucket", "coding", "--on", "--draft-length", "2",
                        "--by", "alice", "--reason", "AL drop is a tokenizer glitch; hold at D=2", "--archive", dsn)
    assert "b-1/coding/* speculation on, draft length <= 2 by alice" in done.stdout
    done = specwatch_ok("flags", "set", "--bundle", "b-1", "--bucket", "chat", "--cohort", "canary", "--off",
                        "--by", "bob", "--reason", "canary paused", "--archive", dsn)

    listed = specwatch_ok("flags", "list", "--archive", dsn)
    coding = next(line for line in listed.stdout.splitlines() if line.startswith("b-1     coding"))
    assert " on " in coding and "manual by alice (automatic: off)" in coding
    canary = next(line for line in listed.stdout.splitlines() if "canary" in line and "bob" in line)
    assert " off " in canary

    cleared = specwatch_ok("flags", "clear", "--bundle", "b-1", "--bucket", "coding", "--by", "carol",
                           "--reason", "drafter retrained", "--archive", dsn)
    assert "b-1/coding/* cleared by carol" in cleared.stdout
    again = specwatch("flags", "clear", "--bundle", "b-1", "--bucket", "coding", "--by", "carol", "--archive", dsn)
    assert again.returncode == 1 and "no manual override on b-1/coding/*" in again.stderr

    with Archive.open(dsn, create=False) as archive:
        audit = [a for a in archive.audit() if a["kind"] != "decision"]
        store = archive.flag_store()
        overrides = archive.overrides()
    assert [(a["kind"], a["actor"], a["scope"], a["reason"]) for a in audit] == [
        ("override", "alice", "b-1/coding/*", "AL drop is a tokenizer glitch; hold at D=2"),
        ("override", "bob", "b-1/chat/canary", "canary paused"),
        ("override_clear", "carol", "b-1/coding/*", "drafter retrained"),
    ]
    assert audit[0]["detail"] == {"enabled": True, "draft_limit": 2}
    assert [(o["bundle_id"], o["bucket"], o["cohort"], o["by"]) for o in overrides] == [
        ("b-1", "chat", "canary", "bob")]
    assert not store.lookup("b-1", "coding", "main").enabled  # back to the automatic decision
    assert not store.lookup("b-1", "chat", "canary").enabled and store.lookup("b-1", "chat", "main").enabled


def test_a_cohort_pin_covers_that_cohort_in_every_bucket(capsys, dsn):
    code, _, err = run_cli(capsys, "flags", "set", "--bundle", "b-1", "--cohort", "canary", "--off", "--by", "al",
                       "--reason", "canary looks slow", "--archive", dsn)
    assert code == 0, err
    with Archive.open(dsn) as archive:
        store = archive.flag_store()
    assert not store.lookup("b-1", "chat", "canary").enabled
    assert not store.lookup("b-1", "coding", "canary").enabled
    assert store.lookup("b-1", "chat", "main").enabled


def test_flags_refuse_bad_requests(capsys, dsn):
    code, _, err = run_cli(capsys, "flags", "set", "--bundle", "b-1", "--off", "--draft-length", "2", "--by", "al",
                       "--reason", "x", "--archive", dsn)
    assert code == 2 and "--draft-length needs --on" in err
    code, _, err = run_cli(capsys, "flags", "set", "--bundle", "b-1", "--off", "--by", " ", "--reason", "x",
                       "--archive", dsn)
    assert code == 2 and "--by" in err
    with pytest.raises(SystemExit):  # argparse: --by is required
        main(["flags", "set", "--bundle", "b-1", "--off", "--reason", "x", "--archive", dsn])
    with Archive.open(dsn, create=False) as archive:
        assert archive.overrides(active_only=False) == []


def test_flags_use_the_archive_from_the_environment_or_the_default_path(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECWATCH_ARCHIVE", raising=False)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "flags", "set", "--bundle", "b-9", "--off", "--by", "ops", "--reason", "new rollout",
                           "--create")
    assert code == 0, err
    assert (tmp_path / "specwatch-data" / "archive" / "metadata").is_dir()
    monkeypatch.setenv("SPECWATCH_ARCHIVE", f"chdb://{tmp_path}/specwatch-data/archive")
    monkeypatch.chdir("/")
    code, out, _ = run_cli(capsys, "flags", "list", "--json")
    [row] = json_lines(out)
    assert (row["bundle_id"], row["speculation"], row["manual"], row["by"]) == ("b-9", "off", True, "ops")


def test_sql_stops_at_its_memory_cap_and_a_statement_cannot_lift_it(query):
    statement = "SELECT groupArray(number) FROM numbers(50000000)"  # about 400 MB of array
    assert query("sql", "--max-memory-mib", "64", statement) == (
        1, "", "specwatch query: query stopped: it needed more than 64 MiB of memory (max_memory_usage); "
               "narrow the statement or raise --max-memory-mib\n")
    code, out, err = query("sql", "--max-memory-mib", "64", statement + " SETTINGS max_memory_usage = 0")
    assert (code, out) == (1, "") and "Cannot modify 'max_memory_usage' setting in readonly mode" in err
    assert query("sql", "--max-memory-mib", "0", "SELECT 1") == (
        2, "", "specwatch query: refused: max_memory_mib must be a positive whole number of MiB, not 0\n")
    code, out, _ = query("sql", "--max-memory-mib", "64", "SELECT count() FROM numbers(1000)")
    assert code == 0 and out.split()[-1] == "1000"
