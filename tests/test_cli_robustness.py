"""One wrong command never destroys evidence, and input that is not telemetry never looks like success.

Each case runs the real command line in-process on seeded inputs and checks the exit code,
the one line on stderr, and the bytes of every file involved.
"""

from __future__ import annotations

import gzip
import json
import os

import pytest

from specwatch.outputs import open_output

from machine import run_cli

_CARD = {"target": {"model_id": "m", "revision": "r1", "tokenizer_digest": "t", "quantization": "fp8"},
         "drafter": {"mechanism": "eagle3", "revision": "d1", "draft_length": 4}}


def _telemetry_lines(steps: int = 40) -> list[str]:
    lines = [json.dumps({"kind": "bundle", "v": 1, "ts": 100.0, "worker": "w1", "bundle_id": "b1", "card": _CARD})]
    for seq in range(steps):
        lines.append(json.dumps({
            "kind": "step", "v": 1, "ts": 100.0 + seq * 0.01, "worker": "w1", "seq": seq, "bundle_id": "b1",
            "draft_ms": 0.9, "verify_ms": 11.8, "kv_usage": 0.6,
            "requests": [{"id": f"r{seq % 3}", "bucket": "coding", "cohort": "main", "drafted": 4, "accepted": 3}]}))
    return lines


@pytest.fixture
def telemetry(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    path.write_text("\n".join(_telemetry_lines()) + "\n")
    return path


@pytest.mark.parametrize("output, link", [("telemetry.jsonl", None), ("./telemetry.jsonl", None),
                                          ("link.jsonl", os.symlink), ("hard.jsonl", os.link)])
def test_replay_refuses_to_write_over_its_input_however_it_is_spelled(capsys, telemetry, tmp_path, monkeypatch,
                                                                      output, link):
    before = telemetry.read_bytes()
    monkeypatch.chdir(tmp_path)
    if link is not None:
        link("telemetry.jsonl", output)
    code, out, err = run_cli(capsys, "replay", "telemetry.jsonl", "--output", output)
    assert code == 2
    assert err == f"specwatch replay: the output {output} is the input telemetry.jsonl; write the output to another file\n"
    assert out == ""
    assert telemetry.read_bytes() == before


def test_replay_refuses_to_write_over_its_policy_file(capsys, telemetry, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[kv]\nwatermark = 0.9\n")
    code, _, err = run_cli(capsys, "replay", telemetry, "--policy", policy, "--output", policy)
    assert code == 2 and "is the input" in err
    assert policy.read_text() == "[kv]\nwatermark = 0.9\n"


def test_an_output_that_cannot_be_written_is_named_as_given(capsys, telemetry, tmp_path):
    output = tmp_path / "missing" / "decisions.jsonl"
    code, _, err = run_cli(capsys, "replay", telemetry, "--output", output)
    assert (code, err) == (2, f"specwatch replay: {output}: No such file or directory\n")


def test_open_output_replaces_only_on_success_and_keeps_the_mode(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    target.chmod(0o640)
    with pytest.raises(RuntimeError):
        with open_output(str(target)) as stream:
            stream.write("half a")
            raise RuntimeError("the run failed")
    assert target.read_text() == "old\n"
    with open_output(str(target)) as stream:
        stream.write("new\n")
    assert target.read_text() == "new\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_simulate_writes_its_output_whole(capsys, tmp_path):
    output = tmp_path / "sim.jsonl"
    code, _, err = run_cli(capsys, "simulate", "--output", output, "--minutes", "0.05", "--workers", "1")
    assert code == 0, err
    lines = output.read_text().splitlines()
    assert lines and f"-> {output}: {len(lines)} records" in err
    assert [p.name for p in tmp_path.iterdir()] == ["sim.jsonl"]


_NOT_JSON_LINES = "is not JSON Lines telemetry: none of its"


@pytest.mark.parametrize("name, content, said, earlier", [
    ("model.bin", b"\x00\x01\xfe\xff" * 100 + b"\n" + b"\x89PNG\r\n\x1a\n",
     f"{_NOT_JSON_LINES} 3 lines is a contract-v1 record (3 invalid_json)", None),
    ("picture.png", bytes(range(256)) * 40, _NOT_JSON_LINES, '{"earlier": "decisions"}\n'),
    ("cut.jsonl.gz", None, "is a damaged gzip file", None),
])
def test_input_that_is_not_telemetry_is_one_line_and_leaves_the_output_as_it_was(
        capsys, telemetry, tmp_path, name, content, said, earlier):
    source, output = tmp_path / name, tmp_path / "decisions.jsonl"
    source.write_bytes(gzip.compress(telemetry.read_bytes())[:300] if content is None else content)
    if earlier is not None:
        output.write_text(earlier)
    code, out, err = run_cli(capsys, "replay", source, "--output", output)
    assert (code, out, len(err.splitlines())) == (1, "", 1)
    assert err.startswith(f"specwatch replay: {source} {said}")
    assert output.read_text() == earlier if earlier is not None else not output.exists()
    # and no temporary file is left
    assert {p.name for p in tmp_path.iterdir()} - {"decisions.jsonl"} == {name, "telemetry.jsonl"}


@pytest.mark.parametrize("name, encode", [("telemetry.jsonl.gz", gzip.compress),
                                          ("bom.jsonl", lambda data: b"\xef\xbb\xbf" + data)])
def test_gzipped_or_marked_telemetry_replays_like_the_plain_file(capsys, telemetry, tmp_path, name,
                                                                 encode):
    variant = tmp_path / name
    variant.write_bytes(encode(telemetry.read_bytes()))
    for source, output in ((telemetry, "a.jsonl"), (variant, "b.jsonl")):
        code, out, _ = run_cli(capsys, "replay", source, "--output", tmp_path / output, "--json")
        summary = json.loads(out)
        assert (code, summary["records"], summary["rejected"]) == (0, 41, 0)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_an_empty_input_is_no_error(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out, _ = run_cli(capsys, "replay", empty, "--output", tmp_path / "d.jsonl", "--json")
    assert code == 0 and json.loads(out)["lines"] == 0
    assert (tmp_path / "d.jsonl").read_text() == ""


_BAD_DSNS = {
    "nonsense://x": "archive DSN scheme 'nonsense' is not one of chdb, http, https (from --archive)",
    "chdb://": "archive DSN 'chdb://' is not chdb:///abs/path, chdb://relative/path or "
               "http(s)://[user[:password]@]host[:port][/database] (from --archive)",
    "foo": "archive DSN 'foo' is not chdb:///abs/path, chdb://relative/path or "
           "http(s)://[user[:password]@]host[:port][/database] (from --archive)",
    "https://[::1": "archive DSN 'https://[::1' is not a URL (Invalid IPv6 URL) (from --archive)",
    "http://ops:hunter2@ch:99999/db": "archive DSN 'http://ops:***@ch:99999/db' is not a URL "
                                      "(Port out of range 0-65535) (from --archive)",
}
_ARCHIVE_COMMANDS = {
    "replay": ["replay", "{telemetry}", "--output", "{tmp}/decisions.jsonl"],
    "demo": ["demo", "--minutes", "0.1", "--outdir", "{tmp}/demo"],
    "query": ["query", "decisions"],
    "explain": ["explain", "d-000000000000"],
    "flags": ["flags", "list"],
    "bundles": ["bundles", "list"],
    "run": ["run", "--bootstrap", "127.0.0.1:9"],
}


@pytest.mark.parametrize("dsn", list(_BAD_DSNS))
@pytest.mark.parametrize("command", list(_ARCHIVE_COMMANDS))
def test_every_command_refuses_a_bad_archive_dsn_with_one_line(capsys, telemetry, tmp_path, monkeypatch, command, dsn):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(telemetry=telemetry, tmp=tmp_path) for a in _ARCHIVE_COMMANDS[command]]
    code, out, err = run_cli(capsys, *argv, "--archive", dsn)
    assert code == 2
    assert err == f"specwatch {command}: {_BAD_DSNS[dsn]}\n"
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["telemetry.jsonl"]  # no work was started


def test_a_bad_archive_dsn_in_the_environment_is_named_as_such(capsys, telemetry, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECWATCH_ARCHIVE", "foo")
    code, _, err = run_cli(capsys, "query", "decisions")
    assert code == 2 and err.endswith("(from $SPECWATCH_ARCHIVE)\n")
    code, _, err = run_cli(capsys, "replay", telemetry, "--output", tmp_path / "d.jsonl", "--archive", "")
    assert code == 2
    assert err == ("specwatch replay: --archive is empty: give chdb:///abs/path, chdb://relative/path or "
                   "http(s)://host[:port][/database]\n")
