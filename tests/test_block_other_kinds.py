"""Records of the other kinds (request, shadow, bundle) in a JSON Lines block decode as
`decode_line` decodes each line, edge values, repeated keys and rejections alike."""

from __future__ import annotations

import json

import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas.codec import decode_line, encode_record
from specwatch.schemas.lines_block import decode_lines_block

_REQUEST = ('{"v":1,"ts":1767225600.022999,"kind":"request","worker":"w3","bundle_id":"b-1","id":"w3-1",'
            '"bucket":"long_context","cohort":"main","speculative":true,"ttft_ms":236.022,"tpot_ms":7.389,'
            '"e2e_ms":1056.248,"output_tokens":112,"finish_reason":"stop","error":null,"sample":{"prompt_sha256":'
            '"ab","output_sha256":"cd","sampling":{"temperature":0.0,"top_p":1.0,"seed":873434206,"max_tokens":1024}}}')
_SHADOW = '{"v":1,"ts":5.0,"kind":"shadow","bundle_id":"b","id":"r","bucket":"coding","check":"token_exact","match":true}'


def _edited(line: str, tail: str = "", **fields) -> str:
    """``line`` with ``fields`` set (in place, or added at the end) and ``tail`` written before its last brace."""
    record = json.loads(line)
    record.update(fields)
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
    return text[:-1] + tail + "}"


EDGE_LINES = [
    _REQUEST, _SHADOW,
    _edited(_SHADOW, tail=',"match":5'), _edited(_SHADOW, match=5, tail=',"match":false'),  # the last key wins
    _edited(_REQUEST, tail=',"ttft_ms":-1'), _edited(_REQUEST, ttft_ms=-1, tail=',"ttft_ms":2'),
    _edited(_REQUEST, id="r\\u00e9"), _edited(_REQUEST, id="r\u00e9\u2764"), _edited(_REQUEST, id="r\x00"),
    _REQUEST.replace('"w3-1"', '"r\\u0000"'), _REQUEST.replace('"w3-1"', '"r\\ud800"'),
    _REQUEST.replace('"w3-1"', '"r\\ud83d\\ude00"'), _REQUEST.replace('"error":null', '"error":"e\\ud800"'),
    _edited(_REQUEST, ts=5), _edited(_REQUEST, ts=-0.0), _edited(_REQUEST, ts=-1), _edited(_REQUEST, ts="5"),
    _REQUEST.replace('"ttft_ms":236.022', '"ttft_ms":1e400'), _REQUEST.replace('"ttft_ms":236.022', '"ttft_ms":NaN'),
    _REQUEST.replace('"ttft_ms":236.022', '"ttft_ms":1E2'), _REQUEST.replace('"ttft_ms":236.022', '"ttft_ms":0.1000000000000000055511151231257827'),
    _edited(_REQUEST, output_tokens=1e2), _edited(_REQUEST, output_tokens=10 ** 30), _edited(_REQUEST, output_tokens=-1),
    _edited(_REQUEST, v=1.0), _edited(_REQUEST, v=True), _edited(_REQUEST, v=2), _edited(_REQUEST, speculative="true"),
    _edited(_REQUEST, speculative=1), _edited(_REQUEST, finish_reason="done"), _edited(_REQUEST, bucket="*"),
    _edited(_REQUEST, cohort="a/b"), _edited(_REQUEST, worker=""), _edited(_REQUEST, worker="w" * 300),
    _edited(_REQUEST, extra={"x": [1, {"y": None}]}), _edited(_REQUEST, sample={"sampling": {"top_p": 2}}),
    _edited(_REQUEST, sample={"sampling": {"seed": 1.5}}), _edited(_REQUEST, sample={"sealed": 5}),
    _edited(_REQUEST, sample=None), _edited(_REQUEST, sample={"extra": 1}), _edited(_REQUEST, tpot_ms=None),
    " \t" + _REQUEST + " \r", _REQUEST + " x", _REQUEST + _REQUEST, _REQUEST.replace(":", " : "),
    _edited(_SHADOW, match=1), _edited(_SHADOW, check=""), _edited(_SHADOW, kind="Shadow"),
]


def _bundle_lines() -> list[str]:
    lines = [encode_record(record) for record in Simulator("acceptance_drop", seed=3, minutes=0.05, workers=2).records()]
    bundles = [line for line in lines if '"kind":"bundle"' in line][:2]
    card = json.loads(bundles[0])["card"]
    return bundles + [_edited(bundles[0], card={**card, "drafter": {**card["drafter"], "mechanism": "magic"}}),
                      _edited(bundles[0], card={**card, "drafter": {**card["drafter"], "draft_length": 0}}),
                      _edited(bundles[0], card={**card, "target": ["m"]})]


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_other_kinds_in_a_block_decode_as_line_by_line(native):
    lines = EDGE_LINES + _bundle_lines()
    reference = [decode_line(line.encode()) for line in lines]
    block = decode_lines_block([line.encode() for line in lines], native)
    assert block.at == [] and block.others == [(i, item) for i, item in enumerate(reference) if item is not None]
    kinds = [type(item).__name__ for _, item in block.others]
    assert kinds.count("RequestRecord") >= 10 and kinds.count("BundleRecord") == 2 and "Rejection" in kinds
    # the repeated key: the last one decides, either way round
    assert block.others[2][1].reason == "invalid_value" and block.others[3][1].match is False
