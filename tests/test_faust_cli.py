"""`specwatch run` and `specwatch simulate --bootstrap` refuse what they cannot do, with exit code 2."""

from __future__ import annotations

import pytest

from specwatch.cli import main

from machine import free_port


@pytest.mark.parametrize("command", ["run", "simulate"])
def test_run_and_simulate_refuse_an_unreachable_broker(command, tmp_path, capsys):
    closed = f"127.0.0.1:{free_port()}"
    if command == "run":
        argv = ["--data-dir", str(tmp_path)]
    else:
        argv = ["--scenario", "healthy", "--minutes", "0.1"]
    assert main([command, "--bootstrap", closed, *argv]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach Kafka at {closed}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--bootstrap", "localhost"], "bootstrap must be HOST:PORT"),
    (["--bootstrap", "h:1", "--workers", "0"], "--workers must be >= 1"),
    (["--bootstrap", "h:1", "--workers", "2", "--archive", "chdb://x"], "a chDB archive opens in one process"),
    (["--bootstrap", "h:1", "--telemetry-topic", "t", "--partials-topic", "t"], "must differ"),
    (["--bootstrap", "h:1", "--session-timeout", "1"], "session_timeout_seconds must be >= 6"),
    (["--bootstrap", "h:1", "--policy", "/nonexistent/policy.toml"], "policy"),
])
def test_run_refuses_bad_settings_before_connecting(argv, message, tmp_path, capsys):
    assert main(["run", *argv, "--data-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "give --output FILE or --bootstrap"),
    (["--output", "x.jsonl", "--bootstrap", "h:1"], "give --output FILE or --bootstrap"),
    (["--bootstrap", "h:1", "--rate", "-5"], "--rate must be >= 0"),
])
def test_simulate_needs_exactly_one_destination(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err
