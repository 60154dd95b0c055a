"""The output rule: a regular file appears whole or not at all; a device, a FIFO, stdout or a
descriptor the shell opened is written in place and never replaced; no input is ever an output.

The commands run as real processes against real destinations: device nodes, a FIFO with a
reader, a file the shell opened for append, a pipe. A `hypothesis` suite drives
`specwatch.outputs.open_output` over every kind of destination, with and without a failure.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specwatch.outputs import OutputClashError, check_not_an_input, open_output, writes_stdout

from machine import CLI, specwatch

_SIMULATE = ("simulate", "--minutes", "0.02", "--seed", "3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """What ``simulate`` writes to a regular file: every other destination must get these bytes."""
    path = tmp_path_factory.mktemp("reference") / "telemetry.jsonl"
    done = specwatch(*_SIMULATE, "--output", str(path))
    assert done.returncode == 0, done.stderr
    data = path.read_bytes()
    assert data.count(b"\n") == 727
    return data


def _identity(path: str) -> tuple[int, int, int, int]:
    found = os.stat(path)
    return found.st_ino, found.st_dev, stat.S_IFMT(found.st_mode), found.st_rdev


@pytest.mark.parametrize("device", ["/dev/null", "/dev/stdout"])
def test_a_device_is_written_in_place_and_stays_a_device(device):
    before = _identity("/dev/null")
    with open("/dev/null", "wb") as null:  # /dev/stdout is then /dev/null too, through the descriptor
        done = subprocess.run([*CLI, *_SIMULATE, "--output", device], stdout=null, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _identity("/dev/null") == before
    assert stat.S_ISCHR(before[2])


def test_a_full_device_is_one_line_and_a_failure_and_stays_a_device():
    before = _identity("/dev/full")
    done = specwatch(*_SIMULATE, "--output", "/dev/full")
    assert (done.returncode, done.stderr) == (
        1, "specwatch simulate: error: cannot write /dev/full: No space left on device\n")
    assert _identity("/dev/full") == before


def test_a_file_the_shell_opened_for_append_keeps_its_earlier_lines(tmp_path, reference):
    log = tmp_path / "log.txt"
    log.write_bytes(b"earlier line 1\nearlier line 2\n")
    inode = log.stat().st_ino
    for _ in range(2):  # `specwatch simulate --output /dev/stdout >> log.txt`, twice
        with open(log, "ab") as appended:
            done = subprocess.run([*CLI, *_SIMULATE, "--output", "/dev/stdout"], stdout=appended,
                                  stderr=subprocess.PIPE, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert log.read_bytes() == b"earlier line 1\nearlier line 2\n" + reference + reference
    assert log.stat().st_ino == inode


@pytest.mark.parametrize("spelling", ["/dev/stdout", "/proc/self/fd/1", "/dev/fd/1", "-"])
def test_a_pipe_is_written_through(spelling, reference):
    done = subprocess.run([*CLI, *_SIMULATE, "--output", spelling], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference
    assert done.stderr.startswith(b"simulate: scenario demo, seed 3, 8 workers, 0.02 min -> stdout: 727 records")


def test_replay_into_a_pipe_puts_its_summary_on_stderr(tmp_path, reference):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(reference)
    expected = tmp_path / "decisions.jsonl"
    assert specwatch("replay", str(telemetry), "--output", str(expected)).returncode == 0
    done = subprocess.run([*CLI, "replay", str(telemetry), "--output", "/dev/stdout"], capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.read_bytes()
    assert b"records read: 727 lines, 727 valid, 0 rejected\n" in done.stderr


def test_a_fifo_is_written_to_its_reader_and_stays_a_fifo(tmp_path, reference):
    fifo = tmp_path / "telemetry.fifo"
    os.mkfifo(fifo)
    before = _identity(str(fifo))
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    done = specwatch(*_SIMULATE, "--output", str(fifo))
    reader.join(timeout=60)
    assert done.returncode == 0, done.stderr
    assert received == [reference]
    assert _identity(str(fifo)) == before and stat.S_ISFIFO(before[2])


def test_replay_refuses_to_append_to_its_own_input_through_a_descriptor(tmp_path, reference):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(reference)
    with open(telemetry, "ab") as appended:  # `replay telemetry.jsonl --output /dev/stdout >> telemetry.jsonl`
        done = subprocess.run([*CLI, "replay", str(telemetry), "--output", "/dev/stdout"], stdout=appended,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == (f"specwatch replay: the output /dev/stdout is the input {telemetry}; "
                           "write the output to another file\n")
    assert telemetry.read_bytes() == reference


def test_replay_refuses_an_output_inside_the_archive_it_writes(tmp_path, reference):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(reference)
    archive = tmp_path / "archive"
    done = specwatch("replay", str(telemetry), "--output", str(tmp_path / "decisions.jsonl"),
                     "--archive", f"chdb://{archive}")
    assert done.returncode == 0, done.stderr
    metadata = sorted(p for p in (archive / "metadata").iterdir() if p.is_file())
    assert metadata, "the archive keeps its database in metadata/"
    kept = {p: p.read_bytes() for p in metadata}
    for output in (metadata[0], archive / "metadata" / ".." / "new.jsonl", archive):
        done = specwatch("replay", str(telemetry), "--output", str(output), "--archive", f"chdb://{archive}")
        assert done.returncode == 2
        assert done.stderr == (f"specwatch replay: the output {output} is inside {archive}, which this command "
                               "reads; write the output elsewhere\n")
    assert {p: p.read_bytes() for p in metadata} == kept
    assert not (archive / "new.jsonl").exists()
    done = specwatch("query", "decisions", "--archive", f"chdb://{archive}")
    assert done.returncode == 0, done.stderr  # the archive still opens


def test_explain_refuses_an_html_page_inside_the_archive(tmp_path):
    archive = tmp_path / "archive"
    archive.mkdir()
    done = specwatch("explain", "d-1", "--archive", f"chdb://{archive}", "--html", str(archive / "page.html"))
    assert done.returncode == 2
    assert done.stderr == (f"specwatch explain: the output {archive / 'page.html'} is inside {archive}, which "
                           "this command reads; write the output elsewhere\n")
    assert list(archive.iterdir()) == []


def test_explain_and_tune_refuse_the_default_archive_from_the_environment(tmp_path):
    archive = tmp_path / "archive"
    environment = dict(os.environ, SPECWATCH_ARCHIVE=f"chdb://{archive}")
    for command in (("explain", "d-1"), ("tune",)):
        done = specwatch(*command, "--html", str(archive / "x.html"), env=environment)
        assert done.returncode == 2 and "which this command reads" in done.stderr, done.stderr
    assert not archive.exists()


def test_tune_refuses_an_html_page_over_its_model_config_or_a_key_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"num_attention_heads": 32, "num_key_value_heads": 8}')
    key = tmp_path / "sample.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    done = specwatch("tune", "--archive", f"chdb://{tmp_path / 'a'}", "--model-config", str(config),
                     "--html", str(tmp_path / "." / "config.json"))
    assert (done.returncode, done.stderr) == (2, f"specwatch tune: the output {tmp_path / '.' / 'config.json'} is "
                                                 f"the input {config}; write the output to another file\n")
    environment = dict(os.environ, SPECWATCH_SAMPLE_KEY_FILE=str(key))
    done = specwatch("explain", "d-1", "--archive", f"chdb://{tmp_path / 'a'}", "--html", str(key), env=environment)
    assert (done.returncode, done.stderr) == (2, f"specwatch explain: the output {key} is the input {key}; "
                                                 "write the output to another file\n")
    assert config.read_text() == '{"num_attention_heads": 32, "num_key_value_heads": 8}'
    assert key.read_bytes() == b"k" * 32


def test_writes_stdout_knows_every_spelling_of_this_process_stdout(tmp_path):
    link = tmp_path / "out"
    link.symlink_to("/dev/stdout")
    assert [writes_stdout(p) for p in ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1", str(link),
                                       f"/proc/{os.getpid()}/fd/1", "/dev/stderr", "/dev/null", "1")] == [
        True, True, True, True, True, True, False, False, False]


# --- the rule over every kind of destination ----------------------------------------------------

_KINDS = ("regular", "missing", "symlink", "device", "fifo", "append_fd", "pipe_fd", "input")


class _Destination:
    """One destination of a kind, with what must hold for it after a write that did or did not finish."""

    def __init__(self, kind: str, root: Path, earlier: bytes) -> None:
        self.kind, self.earlier = kind, earlier
        self.inputs: list[str] = []
        self.descriptors: list[int] = []
        self.received: list[bytes] = []
        self.reader: threading.Thread | None = None
        if kind in ("regular", "symlink", "input", "append_fd"):
            self.file = root / "target.jsonl"
            self.file.write_bytes(earlier)
        if kind == "regular":
            self.path = str(self.file)
        elif kind == "missing":
            self.file = root / "new.jsonl"
            self.path = str(self.file)
        elif kind == "symlink":
            (root / "link.jsonl").symlink_to("target.jsonl")
            self.path = str(root / "link.jsonl")
        elif kind == "input":  # the input, under another spelling: a hard link through a dot
            os.link(self.file, root / "hard.jsonl")
            self.inputs = [str(self.file)]
            self.path = str(root / "." / "hard.jsonl")
        elif kind == "device":
            self.path = "/dev/null"
        elif kind == "fifo":
            self.path = str(root / "out.fifo")
            os.mkfifo(self.path)
            self.reader = threading.Thread(target=lambda: self.received.append(Path(self.path).read_bytes()))
            self.reader.start()
        elif kind == "append_fd":
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND)
            self.descriptors.append(fd)
            self.path = f"/dev/fd/{fd}"
        elif kind == "pipe_fd":
            read_end, write_end = os.pipe()
            self.descriptors.append(write_end)
            self.path = f"/proc/self/fd/{write_end}"
            self.reader = threading.Thread(target=lambda: self.received.append(_drain(read_end)))
            self.reader.start()
        self.identity = None if kind == "missing" else _identity(self.path)

    def close(self) -> None:
        for fd in self.descriptors:
            os.close(fd)
        if self.reader is not None:
            if self.kind == "fifo":
                _release_fifo_reader(self.path, self.reader)
            self.reader.join(timeout=30)
            assert not self.reader.is_alive()


def _release_fifo_reader(path: str, reader: threading.Thread) -> None:
    """Stand in for a writer that never came, so a reader waiting on the FIFO sees its end.

    Opening for writing without blocking fails (ENXIO) while no reader has the FIFO open: the
    reader may not have opened it yet, or may have read the end and closed it before appending
    what it read. Try again until the reader is done or is there to be released."""
    while reader.is_alive():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
        reader.join(timeout=0.01)


def _drain(read_end: int) -> bytes:
    with open(read_end, "rb") as stream:
        return stream.read()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(_KINDS), earlier=st.binary(max_size=300),
       chunks=st.lists(st.text(max_size=200), max_size=5), fail_after=st.none() | st.integers(0, 4))
def test_open_output_keeps_every_destination_whole_and_of_its_kind(tmp_path_factory, kind, earlier, chunks,
                                                                  fail_after):
    root = tmp_path_factory.mktemp("destination")
    destination = _Destination(kind, root, earlier)
    written = "".join(chunks[:fail_after] if fail_after is not None else chunks).encode()
    failed = fail_after is not None and fail_after < len(chunks)
    outcome, after = None, None
    try:
        with open_output(destination.path, inputs=destination.inputs) as stream:
            for index, chunk in enumerate(chunks):
                if index == fail_after:
                    raise RuntimeError("the command failed half way")
                stream.write(chunk)
    except RuntimeError:
        outcome = "failed"
    except OutputClashError:
        outcome = "refused"
    finally:
        if destination.identity is not None:
            after = _identity(destination.path)  # before the descriptors behind /dev/fd/N close
        destination.close()
    if kind == "input":
        assert outcome == "refused"
        assert destination.file.read_bytes() == earlier  # neither replaced nor touched
        return
    assert outcome == ("failed" if failed else None)
    if kind in ("regular", "symlink", "missing"):
        # whole or not at all: the earlier bytes (nothing for a new file), or every byte written
        if not failed:
            assert destination.file.read_bytes() == written
        elif kind == "missing":
            assert not destination.file.exists()
        else:
            assert destination.file.read_bytes() == earlier
        if kind == "symlink":
            assert os.path.islink(destination.path)
        assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []
        return
    # a stream is never replaced: the same inode, of the same type
    assert after == destination.identity
    if kind == "append_fd":  # what was written before a failure stays, after the earlier bytes
        assert destination.file.read_bytes() == earlier + written
    elif kind in ("fifo", "pipe_fd"):
        assert destination.received == [written]


def test_check_not_an_input_leaves_streams_alone_and_finds_a_descriptor_on_an_input(tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text("{}\n")
    check_not_an_input("/dev/null", [str(telemetry)], [str(tmp_path)])
    descriptor = os.open(telemetry, os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(OutputClashError, match=f"is the input {telemetry}"):
            check_not_an_input(f"/dev/fd/{descriptor}", [str(telemetry)])
        with pytest.raises(OutputClashError, match=f"is inside {tmp_path}"):
            check_not_an_input(f"/proc/self/fd/{descriptor}", [], [str(tmp_path)])
    finally:
        os.close(descriptor)
    assert telemetry.read_text() == "{}\n"


def test_a_picture_keeps_an_appended_file_and_never_names_an_input(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specwatch.outputs import save_figure

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    log = tmp_path / "log.bin"
    log.write_bytes(b"earlier\n")
    inode = log.stat().st_ino
    with open(log, "ab") as appended:  # `... --plot /dev/stdout >> log.bin`
        save_figure(fig, f"/proc/self/fd/{appended.fileno()}")
    data = log.read_bytes()
    assert data.startswith(b"earlier\n\x89PNG\r\n\x1a\n") and log.stat().st_ino == inode
    picture = tmp_path / "p.png"
    save_figure(fig, picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)
    policy = tmp_path / "policy.toml"
    policy.write_text("")
    done = specwatch("evaluate", "--quick", "--policy", str(policy), "--plot", str(policy))
    assert (done.returncode, done.stderr) == (2, f"specwatch evaluate: the output {policy} is the input {policy}; "
                                                 "write the output to another file\n")
    assert policy.read_text() == ""
    key = tmp_path / "bench-keys.png"  # the keys figure goes beside the named one
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    done = specwatch("bench", "--smoke", "--section", "stream", "--plot", str(tmp_path / "bench.png"),
                     env=dict(os.environ, SPECWATCH_SAMPLE_KEY_FILE=str(key)))
    assert (done.returncode, done.stderr) == (2, f"specwatch bench: the output {key} is the input {key}; "
                                                 "write the output to another file\n")
    assert key.read_bytes() == b"k" * 32
