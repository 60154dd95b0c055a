"""The archive spool shared by processes: several writers spooling into one directory at once, and
one process delivering it meanwhile, lose, tear and duplicate nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

from specwatch.archive.spool import Spool

_WRITERS = 3
_ENTRIES = 150
# Frames bigger than a file object's buffer go out in several writes: without a lock two
# processes' frames would interleave inside one file.
_PAD = 20_000

_WRITER = textwrap.dedent("""
    import os, sys, time
    from specwatch.archive.spool import Spool

    directory, go, writer, entries, pad = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    spool = Spool(directory, segment_bytes=256 << 10, fsync=False)
    while not os.path.exists(go):
        time.sleep(0.001)
    for i in range(entries):
        spool.append({"k": "windows", "rows": [{"writer": writer, "i": i, "pad": "x" * (pad + 97 * i % 5000)}]})
    spool.close()
""")

_DELIVERER = textwrap.dedent("""
    import json, os, sys, time
    from specwatch.archive.spool import Spool

    directory, go, done, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    while not os.path.exists(go):
        time.sleep(0.001)
    rounds = 0
    with open(out, "a") as delivered:
        def write(entries):
            for entry in entries:
                row = entry["rows"][0]
                delivered.write(json.dumps([row["writer"], row["i"], len(row["pad"])]) + "\\n")
            delivered.flush()
        while True:
            finished = os.path.exists(done)
            spool = Spool(directory, fsync=False)
            spool.replay(write)
            spool.close()
            rounds += 1
            if finished:
                break
            time.sleep(0.005)
    print(rounds)
""")


def _spawn(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True)


def test_writers_in_several_processes_and_a_delivery_meanwhile_keep_every_entry_once(tmp_path):
    directory, go, done = tmp_path / "spool", tmp_path / "go", tmp_path / "writers-done"
    delivered = tmp_path / "delivered.jsonl"
    deliverer = _spawn(_DELIVERER, directory, go, done, delivered)
    writers = [_spawn(_WRITER, directory, go, writer, _ENTRIES, _PAD) for writer in range(_WRITERS)]
    go.touch()
    assert [writer.wait() for writer in writers] == [0] * _WRITERS
    done.touch()
    rounds = int(deliverer.communicate()[0])
    assert deliverer.returncode == 0 and rounds >= 2

    rows = [tuple(json.loads(line)) for line in delivered.read_text().splitlines()]
    drained = Spool(directory, fsync=False)  # what the last delivery round left: nothing
    left = []
    assert drained.replay(left.extend) == 0 and left == [] and drained.set_aside_files() == []
    assert drained.stats().corrupt == 0
    expected = [(w, i, _PAD + 97 * i % 5000) for w in range(_WRITERS) for i in range(_ENTRIES)]
    assert Counter(rows) == Counter(expected)  # every entry exactly once, each whole
    for writer in range(_WRITERS):  # and each writer's entries in the order it wrote them
        assert [i for w, i, _ in rows if w == writer] == list(range(_ENTRIES))


def test_two_spools_on_one_directory_in_one_process_share_its_segments(tmp_path):
    """Two sinks' spools on one directory (as two processes have): the second's appends neither
    collide with the first's segment nor land in a segment the first is delivering."""
    first, second = Spool(tmp_path, fsync=False), Spool(tmp_path, fsync=False)
    first.append({"k": "windows", "rows": [{"n": 1}]})
    second.append({"k": "windows", "rows": [{"n": 2}]})
    seen: list[dict] = []

    def deliver(entries: list[dict]) -> None:
        seen.extend(entries)
        second.append({"k": "windows", "rows": [{"n": 3}]})  # arrives while the first delivers

    assert first.replay(deliver) == 2
    assert [e["rows"][0]["n"] for e in seen] == [1, 2]
    later: list[dict] = []
    assert Spool(tmp_path, fsync=False).replay(later.extend) == 1
    assert [e["rows"][0]["n"] for e in later] == [3]
