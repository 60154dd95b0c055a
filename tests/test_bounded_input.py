"""Input is read with bounded memory and CPU: over-long lines, gzip bombs and floods of blank
lines in replay's telemetry; key, policy and model-config files that are devices, FIFOs or huge.

Every case runs the real command line on seeded input and checks the exit code, the line that
says why, and the counts of what was read and rejected.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys

import pytest

from specwatch.schemas import MAX_LINE_BYTES, PolicyError, load_policy
from specwatch.schemas.codec import DecompressionBombError, read_json_lines
from specwatch.schemas.sealed import SampleKey
from specwatch.transport.signing import Keyring

from machine import run_cli

_STEP = {"kind": "step", "v": 1, "ts": 100.0, "worker": "w1", "seq": 0, "bundle_id": "b1", "draft_ms": 0.9,
         "verify_ms": 11.8, "kv_usage": 0.6,
         "requests": [{"id": "r0", "bucket": "coding", "cohort": "main", "drafted": 4, "accepted": 3}]}


def _steps(count: int, first: int = 0) -> bytes:
    return b"".join(json.dumps(dict(_STEP, seq=i, ts=100.0 + i * 0.01)).encode() + b"\n"
                    for i in range(first, first + count))


# Runs the command line in a fresh interpreter and writes that process's own peak resident memory
# (VmHWM: since its exec) to the file named first. The rusage of a waited child would not do: on
# Linux its maxrss keeps the resident size of the process it was forked from, and a test process
# that has run a long suite is hundreds of MB.
_MEASURED = """
import sys
from specwatch.cli import main
out = sys.argv.pop(1)
try:
    code = main(sys.argv[1:])
finally:
    with open("/proc/self/status") as status, open(out, "w") as peak:
        peak.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
sys.exit(code)
"""


def _peak_rss_mib(argv: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    """Run the command line ``specwatch ARGV``; its result and the peak resident memory of that one process."""
    peak = tmp_path / "peak_kib"
    done = subprocess.run([sys.executable, "-c", _MEASURED, str(peak), *argv], capture_output=True, text=True)
    return done, int(peak.read_text()) / 1024


def test_a_line_longer_than_the_limit_is_read_no_further_and_counted(tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    with open(telemetry, "wb") as out:
        out.write(_steps(3))
        out.write(b'{"kind": "step", "pad": "')
        for _ in range(300):  # a 300 MB line, written in pieces: this process stays small (the child
            out.write(b"x" * (1 << 20))  # forked from it starts with its memory)
        out.write(b'"}\n')
        out.write(_steps(2, first=3))
    done, peak = _peak_rss_mib(["replay", str(telemetry), "--output", str(tmp_path / "d.jsonl"), "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["lines"], summary["records"], summary["rejected_by_reason"]) == (6, 5, {"line_too_long": 1})
    assert summary["flagged"] == [{"line": 4, "reason": "line_too_long",
                                   "detail": f"line longer than {MAX_LINE_BYTES} bytes"}]
    assert peak < 300, f"peak RSS {peak:.0f} MiB: the line was kept"


@pytest.mark.parametrize("filler", [b"\0", b"\n"], ids=["zeros", "newlines"])
def test_a_gzip_bomb_is_refused_early_with_one_line(tmp_path, filler):
    bomb = tmp_path / "telemetry.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as out:  # 1 GiB inflated from ~1 MB, written in pieces
        out.write(_steps(2))
        for _ in range(1024):
            out.write(filler * (1 << 20))
    assert bomb.stat().st_size < 1100_000
    output = tmp_path / "d.jsonl"
    done, peak = _peak_rss_mib(["replay", str(bomb), "--output", str(output)], tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(f"specwatch replay: {bomb}: ")
    assert "more than 200 times: refused as a decompression bomb" in done.stderr
    assert done.stderr.endswith(f"; nothing was written to {output}\n") and done.stderr.count("\n") == 1
    assert not output.exists()
    assert peak < 300, f"peak RSS {peak:.0f} MiB"


def test_the_bomb_check_stops_at_the_ratio_and_leaves_real_telemetry_alone():
    honest = gzip.compress(_steps(20_000), 9)  # JSON steps compress about 25 times
    assert len(list(read_json_lines(io.BytesIO(honest)))) == 20_000
    lines = read_json_lines(io.BytesIO(gzip.compress(b"\n" * (64 << 20), 9)))
    with pytest.raises(DecompressionBombError, match=r"inflated from \d+ bytes of gzip, more than 200 times"):
        for count, _ in enumerate(lines, 1):
            pass
    assert count < 32 << 20  # stopped well before the 64 M lines (how far depends on the inflater's chunking)
    plain = list(read_json_lines(io.BytesIO(b"\n" * (4 << 20))))  # plain input: no ratio to take
    assert len(plain) == 4 << 20


def test_blank_lines_are_counted_as_lines_and_never_rejected(capsys, tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(b"\n" * 10_000 + _steps(3) + b"  \r\n" * 5 + b'{"kind": "nope", "v": 1}\n')
    code, out, _ = run_cli(capsys, "replay", telemetry, "--output", tmp_path / "d.jsonl", "--json")
    summary = json.loads(out)
    assert code == 0
    assert (summary["lines"], summary["records"], summary["rejected_by_reason"]) == (10_009, 3, {"unknown_kind": 1})
    assert [f["line"] for f in summary["flagged"]] == [10_009]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "config.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("source, kind", [("/dev/zero", "a character device"), ("fifo", "a FIFO"),
                                          ("dir", "a directory")])
def test_key_policy_and_model_config_files_must_be_regular_files(capsys, tmp_path, fifo, source, kind):
    path = {"fifo": str(fifo), "dir": str(tmp_path)}.get(source, source)
    with pytest.raises(ValueError) as sample:
        SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": path})
    assert str(sample.value) == (f"SPECWATCH_SAMPLE_KEY_FILE={path}: cannot read the sample key file: "
                                 f"{kind}, not a regular file")
    with pytest.raises(ValueError) as signing:
        Keyring.from_env({"SPECWATCH_SIGNING_KEY_FILE": path})
    assert str(signing.value).endswith(f"cannot read the signing key file: {kind}, not a regular file")
    with pytest.raises(PolicyError) as policy:
        load_policy(path)
    assert str(policy.value) == f"cannot read policy file {path}: {kind}, not a regular file"
    code, out, err = run_cli(capsys, "tune", "--archive", f"chdb://{tmp_path}/a", "--model-config", path)
    assert (code, out, err) == (2, "", f"specwatch tune: cannot read the model config {path}: {kind}, "
                                       "not a regular file\n")
    code, _, err = run_cli(capsys, "replay", "-", "--output", tmp_path / "d.jsonl", "--policy", path)
    assert (code, err) == (2, f"specwatch replay: cannot read policy file {path}: {kind}, not a regular file\n")


def test_oversized_key_policy_and_model_config_files_are_refused(capsys, tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as out:
        out.truncate(64 << 20)  # 64 MB of zeros: the wrong file
    big.chmod(0o600)
    with pytest.raises(ValueError, match="cannot read the sample key file: larger than 8192 bytes"):
        SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": str(big)})
    with pytest.raises(PolicyError, match=f"cannot read policy file {big}: larger than 1048576 bytes"):
        load_policy(big)
    code, _, err = run_cli(capsys, "tune", "--archive", f"chdb://{tmp_path}/a", "--model-config", big)
    assert (code, err) == (2, f"specwatch tune: cannot read the model config {big}: larger than 1048576 bytes: "
                              "not a config or key file\n")
