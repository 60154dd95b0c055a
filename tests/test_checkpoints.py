"""Stage-task checkpoints: plain data in a versioned, signed format; what this version wrote loads in
the next (tests/golden/); pickled ones of earlier versions convert, and a hostile pickle runs nothing."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import zlib
from functools import lru_cache
from pathlib import Path

import msgspec
import pytest

from specwatch.schemas import Policy
from specwatch.schemas.checkpoint import CHECKPOINT_VERSION, Checkpoint, CheckpointError, pack_checkpoint
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.stage_tasks import (
    BundleOwner,
    Stage1Task,
    Stage2Task,
    decode_checkpoint,
    decode_partial,
    encode_checkpoint,
    encode_partial,
    route_batches,
)
from specwatch.transport.signing import Keyring, sign_line

from telemetry_log import exporter_batches

GOLDEN = Path(__file__).parent / "golden"
KEY = Keyring.from_secrets(b"checkpoint-test-key-0123456789abcdef")
OTHER_KEY = Keyring.from_secrets(b"another-key-of-32-bytes-or-more-000000")
# Admission on: its judges and stage history are part of the state too.
POLICY = Policy.model_validate({"admission": {"enforce": True}})


@lru_cache(maxsize=None)
def _chunks() -> tuple[bytes, ...]:
    sim = Simulator("bundle_change", seed=11, workers=1, minutes=1.5, incident_at=60.0)
    return tuple(chunk for _, _, chunk in exporter_batches(sim.records()))


def _fold(s1: Stage1Task, s2: Stage2Task, chunks, decided: list) -> None:
    for chunk in chunks:
        _, closed = s1.fold(s1.next_offset or 0, chunk)
        for _, batch in route_batches(closed, 1):
            for output in s2.fold(s2.next_offset or 0, decode_partial(encode_partial(batch))):
                decided += [action.decision.id for action in output.actions]


def _tasks(share: float = 0.9) -> tuple[Stage1Task, Stage2Task, list[str]]:
    """Both task kinds mid-run: open slices, learned baselines, decisions made, admission judged."""
    s1, s2, decided = Stage1Task(POLICY, "t/0"), Stage2Task(POLICY, ("t/0",), BundleOwner(0, 1)), []
    chunks = _chunks()
    _fold(s1, s2, chunks[:int(len(chunks) * share)], decided)
    return s1, s2, decided


def _differences(a, b, path: str = "") -> list[str]:
    """Where two plain states differ, position by position (NaN equals NaN)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}/{i}")]
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("kind", [0, 1], ids=["stage1", "stage2"])
def test_every_task_kind_round_trips_position_by_position(kind):
    task = _tasks()[kind]
    data = encode_checkpoint(task, KEY, "s/t/0")
    restored = decode_checkpoint(data, KEY, "s/t/0")
    assert type(restored) is type(task)
    assert _differences(task.to_state(), restored.to_state()) == []
    assert encode_checkpoint(restored, KEY, "s/t/0") == data  # one state, one byte string


def test_a_restored_pair_decides_what_an_uninterrupted_one_decides():
    s1, s2, decided = _tasks(0.5)
    r1, r2 = (decode_checkpoint(encode_checkpoint(task)) for task in (s1, s2))
    rest = _chunks()[int(len(_chunks()) * 0.5):]
    straight, restored = list(decided), list(decided)
    _fold(s1, s2, rest, straight)
    _fold(r1, r2, rest, restored)
    assert restored == straight and len(straight) >= 3
    assert _differences(s2.to_state(), r2.to_state()) == []


def _payload_range(data: bytes) -> tuple[int, int]:
    """Where the signed payload sits in a checkpoint's bytes."""
    envelope = msgspec.msgpack.decode(data[4:])
    start = data.index(envelope["payload"])
    return start, start + len(envelope["payload"])


@pytest.mark.parametrize("at", [0.0, 0.3, 0.5, 0.99])
def test_one_byte_changed_in_a_signed_checkpoint_is_refused_as_forged(at):
    data = bytearray(encode_checkpoint(_tasks()[1], KEY, "s/t/0"))
    start, end = _payload_range(bytes(data))
    data[start + int((end - start - 1) * at)] ^= 0x01
    with pytest.raises(CheckpointError) as refused:
        decode_checkpoint(bytes(data), KEY, "s/t/0")
    assert refused.value.reason == "forged"


def test_one_byte_changed_in_an_unsigned_checkpoint_does_not_decode():
    data = bytearray(encode_checkpoint(_tasks()[0]))
    start, end = _payload_range(bytes(data))
    data[(start + end) // 2] ^= 0x01
    with pytest.raises(CheckpointError) as refused:
        decode_checkpoint(bytes(data))
    assert refused.value.reason == "undecodable"


def test_wrong_key_missing_signature_and_another_task_are_refused_each_with_its_reason():
    task = _tasks()[0]
    signed = encode_checkpoint(task, KEY, "s/t/0")
    reasons = {}
    for case, data, keyring, name in (("other key", signed, OTHER_KEY, "s/t/0"),
                                      ("unsigned", encode_checkpoint(task, None, "s/t/0"), KEY, "s/t/0"),
                                      ("other task", signed, KEY, "s/t/1"),
                                      ("not ours", b"PK\x03\x04 a zip file", KEY, "s/t/0")):
        with pytest.raises(CheckpointError) as refused:
            decode_checkpoint(data, keyring, name)
        reasons[case] = refused.value.reason
    assert reasons == {"other key": "unknown_key", "unsigned": "unsigned", "other task": "wrong_task",
                       "not ours": "not_a_checkpoint"}
    # without a key nothing can be checked: a signed checkpoint still loads
    assert decode_checkpoint(signed, Keyring(), "s/t/0").next_offset == task.next_offset


def test_an_unknown_format_version_is_refused_with_a_clear_message():
    checkpoint = Checkpoint(CHECKPOINT_VERSION + 1, "stage1", "s/t/0", {}, {})
    data = pack_checkpoint(checkpoint, lambda payload: sign_line(payload, KEY)[0][1].decode())
    with pytest.raises(CheckpointError) as refused:
        decode_checkpoint(data, KEY, "s/t/0")
    assert refused.value.reason == "unsupported_version"
    assert str(refused.value) == ("unsupported_version: checkpoint format version 2 is not one this version reads "
                                  "(it reads 1); the task rebuilds from its source topic")


def test_a_signed_checkpoint_whose_state_does_not_fit_is_refused_not_fatal():
    for state in ({}, {"source": "t/0", "stage": [1, 2]}):
        data = pack_checkpoint(Checkpoint(CHECKPOINT_VERSION, "stage1", "", Policy().model_dump(mode="json"), state),
                               lambda payload: sign_line(payload, KEY)[0][1].decode())
        with pytest.raises(CheckpointError) as refused:
            decode_checkpoint(data, KEY)
        assert refused.value.reason == "undecodable"


# -- golden files: what this version wrote, every later version loads ------------------------------

def _facts(task: Stage1Task | Stage2Task, decided: list[str] = ()) -> dict:
    """What a restored task must know, in words a later version can still check."""
    if isinstance(task, Stage1Task):
        state = task.stage.to_state()
        return {"next_offset": task.next_offset, "records": task.records, "watermark": task.stage.watermark,
                "open_slices": sorted(batch["slice_index"] for batch in state["open"]),
                "rejected": task.rejected.as_dict()}
    stage = task.stage.decider
    return {"next_offset": task.next_offset, "batches": task.batches, "finalized": task.stage.finalized,
            "monitors": sorted("/".join(part or "*" for part in key) for key in stage.monitors),
            "decisions": list(decided), "stages": {b: s.stage for b, s in stage.flags.stages().items()},
            "acceptance_baselines": {"/".join(part or "*" for part in key): monitor.baseline.acceptance_length
                                     for key, monitor in stage.monitors.items() if key[1] is not None}}


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN is "NaN" on both sides


def write_golden() -> None:
    """Write this format version's golden files (once per version: `SPECWATCH_WRITE_GOLDEN=1`)."""
    s1, s2, decided = _tasks()
    for name, task in (("stage1", s1), ("stage2", s2)):
        (GOLDEN / f"v{CHECKPOINT_VERSION}-{name}.ckpt").write_bytes(encode_checkpoint(task, name=f"{name}/t/0"))
    facts = {"stage1": _facts(s1), "stage2": _facts(s2, decided)}
    (GOLDEN / f"v{CHECKPOINT_VERSION}.facts.json").write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("version", [1])
@pytest.mark.parametrize("kind", ["stage1", "stage2"])
def test_golden_checkpoints_of_every_version_load(version, kind):
    if os.environ.get("SPECWATCH_WRITE_GOLDEN") == "1" and version == CHECKPOINT_VERSION and kind == "stage1":
        write_golden()
    facts = json.loads((GOLDEN / f"v{version}.facts.json").read_text())[kind]
    task = decode_checkpoint((GOLDEN / f"v{version}-{kind}.ckpt").read_bytes(), name=f"{kind}/t/0")
    assert _same(_facts(task, facts.get("decisions", ())), facts)
    assert task.next_offset > 0 and (kind == "stage1" or len(task.stage.decider.monitors) > 10)


# -- pickled checkpoints of earlier versions ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["stage1", "stage2"])
def test_a_pickled_checkpoint_of_the_last_pickling_version_converts_with_its_state(kind):
    # written by the last version that pickled, from the same run as `_tasks` (admission on)
    facts = json.loads((GOLDEN / "pickled.facts.json").read_text())[kind]
    task = decode_checkpoint((GOLDEN / f"pickled-{kind}.ckpt").read_bytes())
    assert _same(_facts(task, facts.get("decisions", ())), facts)
    assert _differences(task.to_state(), decode_checkpoint(encode_checkpoint(task)).to_state()) == []


def test_a_pickled_checkpoint_is_refused_with_a_signing_key_unless_conversion_is_asked_for():
    data = (GOLDEN / "pickled-stage1.ckpt").read_bytes()
    with pytest.raises(CheckpointError) as refused:
        decode_checkpoint(data, KEY, convert_pickled=False)
    assert refused.value.reason == "pickled_refused"
    assert decode_checkpoint(data, KEY, convert_pickled=True).next_offset == 171


class _Shell:
    """What an attacker pickles: a reduce that runs a command when loaded."""

    def __init__(self, call, *args) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _pickled(obj) -> bytes:
    return b"SWCP1" + zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 1)


def _hostile(marker: Path) -> dict[str, bytes]:
    import builtins
    import functools
    import subprocess

    from specwatch.schemas.otlp import decode_request

    command = f"touch {marker}"
    task = Stage1Task(Policy(), "t/0")
    held = functools.partial(os.system, command)  # a held step that is a shell, not a record decoder
    return {
        "os.system": _pickled(_Shell(os.system, command)),
        "inside a task": _pickled({"task": task, "x": _Shell(os.system, command)}),
        "subprocess": _pickled(_Shell(subprocess.call, ["touch", str(marker)])),
        "eval": _pickled(_Shell(builtins.eval, f"__import__('os').system({command!r})")),
        "partial of a shell": _pickled(_Shell(functools.partial, os.system, command)),
        "partial state": _pickled(held),
        "getattr": _pickled(_Shell(getattr, "text", "upper")),
        "partial of a project function": _pickled(_Shell(functools.partial, decode_request, b"x")),
    }


def test_a_hostile_pickle_runs_nothing_and_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    for case, data in _hostile(marker).items():
        with pytest.raises(CheckpointError) as refused:
            decode_checkpoint(data)
        assert refused.value.reason == "undecodable", case
        assert "is not a" in str(refused.value), (case, str(refused.value))
        assert not marker.exists(), case
    # the same bytes through the plain unpickler would have run the command: the payload is live
    pickle.load(io.BytesIO(zlib.decompress(_hostile(marker)["os.system"][5:])))
    assert marker.exists()
