"""Small inputs that used to be taken as they came, now refused or honoured with one clear line:
actor names, tune's model config and window, reproduce without vLLM, demo's metrics port and
a demo policy's [capture] section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from specwatch.archive.store import Archive
from specwatch.schemas import Decision, RequestRecord
from specwatch.schemas.sealed import SampleKey, Sealer, token_digest

from machine import CLI, run_cli, specwatch

_SECRET = b"a sample key for tests, 32 bytes"
_PROMPT, _OUTPUT = [17, 4, 2040, 9], [5, 5, 6, 7, 1999]


@pytest.mark.parametrize("name, code_point", [("ops\nroot", "U+000A"), ("\x1b[2Jops", "U+001B"),
                                              ("ops\u202eevil", "U+202E"), ("a\tb", "U+0009")])
def test_who_acts_must_be_a_printable_name(capsys, tmp_path, name, code_point):
    dsn = f"chdb://{tmp_path}/archive"
    code, out, err = run_cli(capsys, "flags", "set", "--bundle", "b-1", "--off", "--by", name, "--reason", "x",
                             "--archive", dsn, "--create")
    assert (code, out) == (2, "")
    assert err == f"specwatch flags: --by must be a printable name: {name.strip()!r} holds {code_point}\n"
    code, _, err = run_cli(capsys, "bundles", "freeze", "b-1", "--by", name, "--reason", "x", "--archive", dsn)
    assert (code, err) == (2, f"specwatch bundles: --by must be a printable name: {name.strip()!r} holds "
                              f"{code_point}\n")
    code, _, err = run_cli(capsys, "reproduce", "d-1", "--actor", name, "--archive", dsn)
    assert (code, err) == (2, f"specwatch reproduce: --actor must be a printable name: {name.strip()!r} holds "
                              f"{code_point}\n")
    assert not (tmp_path / "archive").exists()  # refused before the archive was opened or made


def _archive_with_a_sealed_sample(tmp_path) -> tuple[str, str]:
    key = SampleKey.from_secret(_SECRET)
    record = RequestRecord.model_validate({
        "v": 1, "ts": 100.0, "worker": "w1", "bundle_id": "b-1", "id": "r1", "bucket": "coding", "cohort": "main",
        "speculative": True, "ttft_ms": 5.0, "tpot_ms": 1.0, "e2e_ms": 9.0, "output_tokens": 5,
        "finish_reason": "length",
        "sample": {"prompt_sha256": token_digest(_PROMPT), "output_sha256": token_digest(_OUTPUT),
                   "sealed": Sealer(key).seal(_PROMPT, _OUTPUT, sample_id="r1")}})
    decision = Decision(ts=101.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
                        reason="acceptance_drop", detector="acceptance_gate", sample_ids=["r1"])
    card = {"target": {"model_id": "/m/target"},
            "drafter": {"mechanism": "ngram", "revision": "ngram:lookup=2-3", "draft_length": 4}}
    dsn = f"chdb://{tmp_path}/archive"
    with Archive.open(dsn, environ={}) as archive:
        archive.write_decision(decision, {"card": card}, [record])
    return dsn, decision.id


def test_reproduce_without_vllm_opens_and_audits_nothing(tmp_path):
    dsn, decision_id = _archive_with_a_sealed_sample(tmp_path)
    hidden = tmp_path / "no-vllm"
    (hidden / "vllm").mkdir(parents=True)
    (hidden / "vllm" / "__init__.py").write_text("raise ImportError('No module named vllm')\n")
    key_file = tmp_path / "sample.key"
    key_file.write_bytes(_SECRET)
    key_file.chmod(0o600)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hidden), *sys.path]),
                       SPECWATCH_SAMPLE_KEY_FILE=str(key_file))
    done = specwatch("reproduce", decision_id, "--archive", dsn, env=environment)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("specwatch reproduce: the vllm engine is not available (ImportError: No module named "
                           "vllm); install it with deploy/bootstrap.sh --with-vllm; no sample was opened\n")
    with Archive.open(dsn, environ={}) as archive:
        assert archive.audit(kind="sample_open") == []


@pytest.mark.parametrize("config, problem", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a whole number from 1 to 65536, got 0"),
    ({"num_attention_heads": True}, "num_attention_heads must be a whole number from 1 to 65536, got true"),
    ({"num_attention_heads": 32, "num_key_value_heads": False},
     "num_key_value_heads must be a whole number from 1 to 65536, got false"),
    ({"num_attention_heads": 32, "num_key_value_heads": 0},
     "num_key_value_heads must be a whole number from 1 to 65536, got 0"),
    ({"num_attention_heads": 32.0}, "num_attention_heads must be a whole number from 1 to 65536, got 32.0"),
    ({"num_attention_heads": [32]}, "num_attention_heads must be a whole number from 1 to 65536, got a JSON array"),
    ({"num_attention_heads": 32, "num_key_value_heads": 5}, "num_key_value_heads 5 does not divide "
                                                            "num_attention_heads 32"),
    ([32, 8], "the model config must be a JSON object (a config.json), not a JSON array"),
    ("[" * 100_000 + "]" * 100_000, "not a model config: JSON nested too deeply"),
    ("{nope", "not a JSON model config: Expecting property name enclosed in double quotes: line 1 column 2 "
              "(char 1)"),
])
def test_tune_refuses_model_configs_that_give_no_head_count(capsys, tmp_path, config, problem):
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    code, out, err = run_cli(capsys, "tune", "--archive", f"chdb://{tmp_path}/archive", "--model-config", path)
    assert (code, out, err) == (2, "", f"specwatch tune: {path}: {problem}\n")


@pytest.mark.parametrize("window", ["inf", "nan", "0", "-5"])
def test_tune_refuses_a_window_that_is_not_a_positive_finite_number(capsys, tmp_path, window):
    code, _, err = run_cli(capsys, "tune", "--archive", f"chdb://{tmp_path}/archive", "--window", window)
    assert (code, err) == (2, f"specwatch tune: --window must be a positive, finite number of seconds, "
                              f"got {float(window)}\n")


def test_tune_reports_no_starting_point_when_one_group_fills_a_tile():
    from specwatch.analysis.tuning import render_text, tune_report

    card = {"drafter": {"mechanism": "eagle3", "draft_length": 4}}
    report = tune_report([], card, "b-1", heads_per_kv=128)
    assert (report["heads_per_kv_head"], report["starting_draft_length"]) == (128, None)
    assert render_text(report).splitlines()[1] == (
        "G = 128 query heads per KV head: no starting point (128/G - 1 < 1: one query group fills a 128-row tile)")
    assert tune_report([], card, "b-1", heads_per_kv=64)["starting_draft_length"] == 1


def test_demo_serve_0_prints_the_port_it_bound_and_serves_there(tmp_path):
    demo = subprocess.Popen([*CLI, "demo", "--no-archive", "--minutes", "0.2", "--outdir", str(tmp_path),
                             "--serve", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = demo.stderr.readline()
        assert first.startswith("specwatch demo: metrics on http://127.0.0.1:"), first
        url = first.split(" on ", 1)[1].strip()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert port > 0
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "specwatch_records_read_total" in text
        for line in demo.stderr:
            if line.startswith("serving metrics on"):
                assert line == f"serving metrics on {url} until interrupted (Ctrl-C)\n"
                break
        else:
            pytest.fail("the demo never said where it serves")
    finally:
        demo.terminate()
        demo.communicate(timeout=60)


def test_demo_refuses_a_policy_whose_capture_it_would_ignore(capsys, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[capture]\nenabled = true\nrate = 1.0\n")
    code, out, err = run_cli(capsys, "demo", "--no-archive", "--policy", policy, "--outdir", tmp_path / "out")
    assert (code, out) == (2, "")
    assert err == (f"specwatch demo: {policy} turns on [capture], which the demo cannot honour: the simulated "
                   "fleet has no token ids to seal and the vLLM demo builds its own collector; capture runs in a "
                   "serving engine (SPECWATCH_VLLM_POLICY); remove [capture] or set enabled = false\n")
    assert not (tmp_path / "out").exists()
    policy.write_text("[capture]\nenabled = false\n")  # off: nothing to honour, the demo runs
    code, _, err = run_cli(capsys, "demo", "--no-archive", "--policy", policy, "--minutes", "0.1",
                           "--outdir", tmp_path / "out")
    assert code == 0, err
