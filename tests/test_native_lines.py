"""The compiled JSON Lines step walk (native/src/lines.rs) gives what the reference block decoder
gives, position by position, on the block decoder's own edge cases and on damaged lines."""

from __future__ import annotations

import json
import random

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specwatch.schemas import native_walks
from specwatch.schemas.codec import decode_line, encode_record
from specwatch.schemas.lines_block import decode_lines_block

from test_bad_input import BAD_LINES
from test_block_decoder import _EDGES, _round, _simulated, _step, _steps
from test_fastpath import ODD_LINES, assert_block_is_the_reference, block_outcomes
from test_fuzz_codec import _FUZZ
from test_native_decoder import pytestmark  # noqa: F401  (built wherever cargo is; skipped only without it)


def _walked(lines: list[bytes]) -> list[int]:
    """The positions the compiled walk read as steps itself."""
    return native_walks.LINE_WALK.block(lines)[0]


def _same_both_ways(lines: list[bytes]):
    """Decode with and without the compiled walk: equal outcome at every position, and each what
    `codec.decode_line` gives for its line alone. Returns the block the walk took part in."""
    native = decode_lines_block(lines, native=True)
    reference = decode_lines_block(lines, native=False)
    assert block_outcomes(native) == block_outcomes(reference)
    assert_block_is_the_reference(native, [decode_line(line) for line in lines])
    # the same records built back, and the same keys in the same order where the walk read every step
    assert [native.record(row) for row in range(len(native))] == [reference.record(r) for r in range(len(reference))]
    if len(_walked(lines)) == len(reference):
        assert native.keys == reference.keys
        assert native.round_key.tolist() == reference.round_key.tolist()
    return native


def _writers_line(n: int, **changes) -> bytes:
    """Step ``n`` as `encode_record` writes it (the walk's layout), with ``changes`` to its fields."""
    line = json.loads(_step(n, [_round(), _round("r2", "coding", "canary", 4, 0)]))
    fields = {"v": 1, "ts": line["ts"], "kind": "step", "worker": "w1", "seq": n, "bundle_id": "b",
              "draft_ms": 1.5, "verify_ms": 9.0, "kv_usage": 0.5, "requests": line["requests"], **changes}
    return json.dumps(fields, separators=(",", ":")).encode()


def test_every_step_the_writer_writes_is_the_walks_and_equal_the_reference():
    lines = _simulated()
    steps = [position for position, line in enumerate(lines) if b'"kind":"step"' in line]
    for start in range(0, len(lines), 500):
        block = lines[start:start + 500]
        _same_both_ways(block)
        assert _walked(block) == [p - start for p in steps if start <= p < start + 500]
    # records of other kinds, and the newline a file's lines keep, change nothing
    _same_both_ways([line + b"\n" for line in lines[:300]])
    assert len(_walked([line + b"\r\n" for line in lines[:300]])) == sum(p < 300 for p in steps)


def test_the_block_decoders_edge_cases_decode_the_same():
    good = _writers_line(0)
    block = _same_both_ways([good, *_EDGES, good.replace(b'"seq":0', b'"seq":99')])
    # the walk reads the valid steps in the writer's layout (the step itself, 1, 5, 6, 16, 24);
    # the reference everything else, valid steps of another layout among them
    assert _walked([good, *_EDGES]) == [0, 1, 5, 6, 16, 24]
    assert block.seqs == [0, 1, 5, 6, 8, 14, 15, 16, 17, 18, 19, 24, 25, 26, 28, 29, 30, 31, 34, 99]


# The block decoder's edge cases again, in the writer's key order: the walk's own edges.
_WRITERS_EDGES = [
    (_writers_line(1, requests=[_round(drafted=12, accepted=10), _round("r2", drafted=64, accepted=64),
                                _round("r3", drafted=0, accepted=0)]), True),
    (_writers_line(2, requests=[_round(drafted=65, accepted=1)]), False),
    (_writers_line(3, requests=[_round(drafted=99, accepted=9)]), False),
    (_writers_line(4, requests=[_round(accepted=5)]), False), (_writers_line(5, requests=[]), True),
    (_writers_line(6, requests=[_round("x" * 256)]), True), (_writers_line(7, requests=[_round("x" * 257)]), False),
    (_writers_line(8, requests=[_round("r\u00e9")]), False), (_writers_line(9, requests=[_round("r\x7f")]), False),
    (_writers_line(11, requests=[_round(bucket="*")]), False), (_writers_line(12, requests=[_round(cohort="a/b")]), False),
    (_writers_line(13, requests=[_round(bucket="")]), False), (_writers_line(14, requests=[_round('r"1')]), False),
    (_writers_line(15, requests=[_round("r\\1")]), False), (_writers_line(16, requests=[_round("r}1,{")]), True),
    (_writers_line(17, requests=[_round(bucket="**")]), True), (_writers_line(18, requests=[_round(" ~")]), True),
    (_writers_line(20, requests=[_round(drafted=4.0)]), False), (_writers_line(21, requests=[_round(accepted=True)]), False),
    (_writers_line(22, requests=[_round(accepted=-1)]), False),
    (_writers_line(23, requests=[_round()] * 4097), False), (_writers_line(24, requests=[_round()] * 4096), True),
    (_writers_line(25, requests=[_round(rid='","bucket":"x","cohort":"y","drafted":4,"accepted":3}')]), False),
    (_writers_line(26).replace(b'"drafted":4', b'"drafted":04'), False),
    (_writers_line(27).replace(b'"id":"r1"', b'"id":"r\\u0031"'), False),
    (_writers_line(28).replace(b'"accepted":3}', b'"accepted":3,"accepted":1}'), False),
    (_writers_line(29).replace(b'"accepted":3}', b'"accepted":3 }'), False),
    (_writers_line(30).replace(b',"draft_ms"', b', "draft_ms"'), False), (_writers_line(31) + b" \t\n", True),
    (_writers_line(32) + b"x", False), (_writers_line(33) + b"{}", False),
    (_writers_line(34, ts=17), True), (_writers_line(35, ts=0), True), (_writers_line(36, ts=-0.0), False),
    (_writers_line(37, ts=-1.0), False), (_writers_line(38, ts=1e300), False), (_writers_line(39, ts=2.0 ** 53), False),
    (_writers_line(40, ts=2.0 ** 53 - 1), True), (_writers_line(41, ts=1.5e-7), True),
    (_writers_line(42).replace(b'"ts":142.0', b'"ts":1e999'), False),
    (_writers_line(43).replace(b'"ts":143.0', b'"ts":1.43E2'), True),
    (_writers_line(44).replace(b'"ts":144.0', b'"ts":144.'), False),
    (_writers_line(45).replace(b'"ts":145.0', b'"ts":0145.0'), False),
    (_writers_line(46).replace(b'"ts":146.0', b'"ts":146.000000000000000000001'), False),
    (_writers_line(47, kv_usage=1), True), (_writers_line(48, kv_usage=1.0000001), False),
    (_writers_line(49, kv_usage=0), True), (_writers_line(50, draft_ms=float("nan")), False),
    (_writers_line(51, verify_ms=float("inf")), False), (_writers_line(52, draft_ms=True), False),
    (_writers_line(53, v=2), False), (_writers_line(54, v=True), False), (_writers_line(55, v=1.0), False),
    (_writers_line(56, seq=1.0), False), (_writers_line(57, seq=(1 << 63) - 1), True),
    (_writers_line(58, seq=1 << 63), False), (_writers_line(59, seq=-1), False), (_writers_line(60, seq=1 << 64), False),
    (_writers_line(61, worker=""), False), (_writers_line(62, worker="w" * 256), True),
    (_writers_line(63, worker="w" * 257), False), (_writers_line(64, worker="w\u2764"), False),
    (_writers_line(65, worker="w\x1b[2J"), False), (_writers_line(66, bundle_id=7), False),
    (_writers_line(67, bundle_id="*"), True), (_writers_line(68, bundle_id="a/b"), True),
    (_writers_line(69, requests=5), False), (_writers_line(70, requests="0123456789abcdef"), False),
    (_writers_line(71, kind="request"), False), (_writers_line(72, kind="round"), False),
    (b"\xef\xbb\xbf" + _writers_line(73), False),
]


def test_the_walks_own_edges_decode_the_same_and_only_plain_valid_steps_are_its():
    lines = [line for line, _ in _WRITERS_EDGES]
    _same_both_ways(lines)
    assert _walked(lines) == [i for i, (_, walks) in enumerate(_WRITERS_EDGES) if walks]
    for line, _ in _WRITERS_EDGES:  # alone, too: a block of one line
        _same_both_ways([line])


def test_bad_and_odd_lines_among_steps_decode_the_same():
    lines = _simulated()[:300]
    rng = random.Random(7)
    for bad in ODD_LINES + [line for group in BAD_LINES.values() for line in group] + _EDGES + [
            line for line, _ in _WRITERS_EDGES]:
        lines.insert(rng.randrange(len(lines)), bad if type(bad) is bytes else bad.encode())
    for size in (1, 7, 64, len(lines)):
        for start in range(0, len(lines), size):
            _same_both_ways(lines[start:start + size])


def test_every_truncation_and_flip_of_a_writers_step_decodes_the_same():
    good = _writers_line(5)
    for end in range(len(good) + 1):
        _same_both_ways([good, good[:end], good])
    for at in range(len(good)):
        for flip in (0x01, 0x20, 0x80):
            broken = bytearray(good)
            broken[at] ^= flip
            _same_both_ways([good, bytes(broken), good])


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_random_steps_decode_the_same(lines):
    _same_both_ways(lines)


@_FUZZ
@given(st.lists(st.floats(allow_nan=False) | st.integers(-1, 1 << 60), min_size=4, max_size=4))
@example([5e-324, 1.7976931348623157e308, 0.1, 1.0])
@example([1767225600.012775, 2.579, 7.383, 0.0218])
def test_numbers_read_as_the_reference_reads_them(values):
    ts, draft_ms, verify_ms, kv_usage = values
    line = _writers_line(1, ts=ts, draft_ms=draft_ms, verify_ms=verify_ms, kv_usage=kv_usage)
    # repr's shortest digits, and the same value written with all 17
    longer = line.replace(json.dumps(ts).encode(), b"%.16e" % ts, 1) if type(ts) is float else line
    _same_both_ways([line, longer])


@_FUZZ
@given(st.binary(max_size=300), st.integers(0, 400))
def test_damaged_lines_decode_the_same(noise, at):
    good = _writers_line(9)
    at = min(at, len(good))
    _same_both_ways([good[:at] + noise + good[at:], good, noise])


def test_the_walk_takes_a_step_of_printable_ascii_names_with_every_character():
    names = "".join(map(chr, range(0x20, 0x7F))).replace('"', "").replace("\\", "")
    line = _writers_line(1, worker=names, requests=[_round(names, names.replace("/", ""), "c" + names[:40].replace(
        "/", ""))])
    _same_both_ways([line])
    assert _walked([line]) == [0]


def test_a_line_of_another_type_than_bytes_is_left_to_the_reference():
    good = _writers_line(1)
    assert native_walks.LINE_WALK.block([good, good.decode(), bytearray(good)])[:2] == ([0], [1, 2])
    assert len(decode_lines_block([good, good.decode()], native=True)) == 2
    assert np.frombuffer(native_walks.LINE_WALK.block([good])[2]).tolist() == [101.0]
