"""`specwatch replay`'s reader of plain files in large reads gives the lines `read_json_lines` gives."""

from __future__ import annotations

import gzip
import io
import random

import pytest

from specwatch.commands.replay import _plain_line_blocks, line_blocks
from specwatch.schemas import MAX_LINE_BYTES, read_json_lines

_PIECES = [b"", b"\n", b"\r\n", b" \t\n", b"\xef\xbb\xbf", b"\r", b"x", b"{}", b'{"a":1}', b"\x00"]


def _random_input(rng: random.Random, lines: int) -> bytes:
    """Lines of seeded random pieces and lengths, blank ones, long ones, a BOM maybe, a last
    line with or without its newline."""
    parts = [b"\xef\xbb\xbf"] if rng.random() < 0.5 else []
    for _ in range(lines):
        parts.append(rng.choice(_PIECES) + b"y" * rng.choice([0, 1, 3, 7, 8, 9, 10, 20, 60]) + rng.choice(_PIECES))
        parts.append(b"\n")
    if parts[-1:] == [b"\n"] and rng.random() < 0.5:
        parts.pop()
    return b"".join(parts)


def _chunks(data: bytes, sizes: list[int]):
    """A read function giving ``data`` in pieces of the given sizes, in turn (the size asked is ignored)."""
    stream = io.BytesIO(data)
    turn = iter(sizes * (len(data) + 1))
    return lambda size: stream.read(next(turn))


@pytest.mark.parametrize("seed", range(40))
def test_plain_blocks_give_read_json_lines_lines_at_every_cut(seed):
    rng = random.Random(seed)
    data = _random_input(rng, rng.choice([0, 1, 5, 50, 300]))
    limit = rng.choice([4, 8, 9, 16, 64])
    sizes = [rng.choice([1, 2, 3, 5, 8, 13, 64, 1000]) for _ in range(5)]
    expected = list(read_json_lines(io.BytesIO(data), max_line_bytes=limit))
    blocks = list(_plain_line_blocks(_chunks(data, sizes), max_line_bytes=limit, chunk_bytes=sizes[0]))
    assert [line for block in blocks for line in block] == expected
    assert all(blocks) and all(len(block) == 4096 for block in blocks[:-1])


def test_a_file_in_blocks_of_4096_lines_long_lines_cut_as_read_json_lines_cuts_them(tmp_path):
    rng = random.Random(7)
    lines = [b'{"kind":"step","n":%d}\n' % i for i in range(10_000)]
    lines[5] = b"\xef\xbb\xbf" + lines[5]  # a BOM that is not at the start stays,
    lines[4096] = b"\xef\xbb\xbf" + lines[4096]  # also at the start of the second block
    lines[4_500] = b'{"pad":"' + b"x" * (3 * MAX_LINE_BYTES) + b'"}\n'  # over several reads, cut
    lines[4_501] = b"z" * MAX_LINE_BYTES + b"\n"  # exactly the limit and its newline: kept whole
    lines[7_000:7_000] = [b"\n", b"  \r\n"] * 3
    rng.shuffle(lines[8_000:])
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(lines) + b"last without newline")
    with path.open("rb") as stream:
        blocks = list(line_blocks(stream))
    with path.open("rb") as stream:
        expected = list(read_json_lines(stream))
    assert [len(block) for block in blocks] == [4096, 4096, len(expected) - 8192]
    assert [line for block in blocks for line in block] == expected
    assert blocks[1][4_500 - 4096] == lines[4_500][:MAX_LINE_BYTES + 1]
    assert blocks[0][0] == lines[0] and blocks[0][5] == lines[5] and blocks[1][0] == lines[4096]


def test_gzip_and_pipes_are_read_by_read_json_lines(tmp_path):
    """gzip keeps its bomb check, a pipe each line as it comes: both by `read_json_lines`."""
    data = b"".join(b'{"n":%d}\n' % i for i in range(5000))
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(data))
    with path.open("rb") as stream:
        blocks = list(line_blocks(stream))
    assert [len(block) for block in blocks] == [4096, 904]
    assert b"".join(line for block in blocks for line in block) == data
