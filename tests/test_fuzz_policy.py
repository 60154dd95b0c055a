"""Fuzzing the policy loader: any file content gives a Policy or a PolicyError that names the file
(budget as in test_fuzz_codec)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from specwatch.schemas import Policy, PolicyError, load_policy

from test_fuzz_codec import _FUZZ

# The example of README.md's "Policy file" section, as people copy it.
_README_EXAMPLE = (Path(__file__).resolve().parents[1] / "README.md").read_text().split(
    "## Policy file", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def policy_dir():
    with tempfile.TemporaryDirectory(prefix="specwatch-policy-fuzz-") as directory:
        yield Path(directory)


def _load(directory: Path, content: bytes) -> Policy | PolicyError:
    path = directory / "policy.toml"
    path.write_bytes(content)
    try:
        policy = load_policy(path)
    except PolicyError as error:
        message = str(error)
        assert str(path) in message, message  # says which file
        assert message.strip() and "Traceback" not in message
        return error
    assert isinstance(policy, Policy)
    _check_invariants(policy)
    return policy


def _check_invariants(policy: Policy) -> None:
    """What the loader promises about a policy it accepts."""
    assert 0 < policy.windows.slice_seconds <= 60
    assert 0 <= policy.windows.lateness_seconds <= policy.windows.source_idle_seconds
    assert 0 < policy.kv.watermark <= 1
    assert 0 < policy.acceptance.tolerance < 1
    for value in (policy.baseline.learn_seconds, policy.actions.cooldown_seconds, policy.latency.p99_factor):
        assert math.isfinite(value)
    assert policy.windows.slice_seconds >= 0.1 and policy.actions.cooldown_seconds <= 30 * 86_400
    assert type(policy.acceptance.reduce_first) is bool and type(policy.acceptance.consecutive) is int
    # An accepted policy survives its own JSON form: what replay records is what ran.
    assert Policy.model_validate_json(policy.model_dump_json()) == policy


def test_the_readme_example_loads(policy_dir):
    policy = _load(policy_dir, _README_EXAMPLE.encode())
    assert isinstance(policy, Policy) and policy.baseline.pinned["coding"].acceptance_length == 3.2


@_FUZZ
@given(st.one_of(st.binary(max_size=400), st.text(max_size=400).map(lambda t: t.encode("utf-8", "surrogatepass"))))
@example(b"\xff\xfe")
@example(b"[windows]\nslice_seconds = nan\n")
@example(b"[windows]\nslice_seconds = inf\n")
@example(b"[kv]\nwatermark = 1e400\n")
@example(b"a = " + b"[" * 50_000 + b"]" * 50_000)
@example(b"[" * 10_000)
@example(b"a.b.c.d.e.f.g.h = 1\n" * 50)
@example(b"[baseline.pinned.coding]\nacceptance_length = -inf\n")
@example(b"[actions]\nrestore_reasons = [\"nope\"]\n")
@example(b"baseline_cohort = \"\"\n")
def test_any_file_content_loads_or_is_refused_with_the_file_named(policy_dir, content):
    _load(policy_dir, content)


# -- structured: real section and setting names, values of every TOML type ------------------------

_SECTIONS = {name: list(field.annotation.model_fields)
             for name, field in Policy.model_fields.items() if name != "baseline_cohort"}
_SECTIONS["nonsense"] = ["x"]
_TOML_SCALARS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf") if math.isinf(f) else repr(f)),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=12).map(lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"')
                             .encode("ascii", "backslashreplace").decode().replace("\\x", "\\u00") + '"'),
    st.just("1979-05-27T07:32:00Z"),
)
_TOML_VALUES = st.one_of(_TOML_SCALARS, st.lists(_TOML_SCALARS, max_size=4).map(lambda v: "[" + ", ".join(v) + "]"))


@st.composite
def _policy_text(draw) -> str:
    lines = []
    if draw(st.booleans()):
        lines.append(f"baseline_cohort = {draw(_TOML_VALUES)}")
    for section in draw(st.lists(st.sampled_from(sorted(_SECTIONS)), unique=True, max_size=5)):
        lines.append(f"[{section}]")
        for name in draw(st.lists(st.sampled_from(_SECTIONS[section]), unique=True, max_size=4)):
            lines.append(f"{name} = {draw(_TOML_VALUES)}")
    if draw(st.booleans()):
        bucket = draw(st.sampled_from(["coding", "chat", '"a b"']))
        lines.append(f"[baseline.pinned.{bucket}]")
        for name in draw(st.lists(st.sampled_from(["acceptance_length", "draft_to_verify", "e2e_p99_ms",
                                                   "tpot_p99_ms", "error_rate", "bogus"]), unique=True, max_size=3)):
            lines.append(f"{name} = {draw(_TOML_VALUES)}")
    return "\n".join(lines) + "\n"


@_FUZZ
@given(_policy_text())
def test_structured_policies_load_or_name_the_setting(policy_dir, text):
    result = _load(policy_dir, text.encode())
    if isinstance(result, PolicyError) and "not valid TOML" not in str(result):
        # Each refused setting is named by its dotted path (or the file's top level).
        named = {"baseline_cohort", "(top)"} | set(_SECTIONS)
        for problem in str(result).split(": ", 1)[1].split("; "):
            assert problem.split(":")[0].split(".")[0] in named, str(result)


def test_an_unreadable_or_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.toml")
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path)  # a directory


# -- every setting has sane bounds, and TOML types are not coerced ---------------------------------

def _number_settings():
    """(dotted setting, annotation) for every number or boolean setting, nested sections included."""
    import typing

    from pydantic import BaseModel

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            kinds = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
            kind = kinds[0]
            if typing.get_origin(kind) is typing.Annotated:  # `float | None` with bounds
                kind = typing.get_args(kind)[0]
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from walk(kind, f"{prefix}{name}.")
            elif kind in (int, float, bool):
                yield f"{prefix}{name}", kind
    yield from walk(Policy, "")
    from specwatch.schemas.policy import PinnedBaseline
    yield from walk(PinnedBaseline, "baseline.pinned.coding.")


def _toml(setting: str, value: str) -> bytes:
    *sections, name = setting.split(".")
    header = f"[{'.'.join(sections)}]\n" if sections else ""
    return f"{header}{name} = {value}\n".encode()


_NUMBER_SETTINGS = sorted(_number_settings())


def test_the_audit_covers_every_section():
    assert {s.split(".")[0] for s, _ in _NUMBER_SETTINGS} == {
        "windows", "baseline", "acceptance", "draft_overhead", "speedup", "latency", "kv", "errors", "actions",
        "admission", "capture"}
    assert len(_NUMBER_SETTINGS) == 75  # admission.require_qualification joined the 73, windows.close_on_writers the 74


@pytest.mark.parametrize("setting, kind", _NUMBER_SETTINGS)
def test_no_setting_takes_the_wrong_toml_type_infinity_or_an_absurd_size(policy_dir, setting, kind):
    wrong = ["1"] if kind is bool else ["true", "false", '"1"']
    absurd = [] if kind is bool else ["1e400", "-1e400", "nan", "1e300" if kind is float else str(10 ** 18),
                                      "-1e300" if kind is float else str(-10 ** 18)]
    if kind is int:
        wrong.append("2.0")
    for value in wrong + absurd:
        result = _load(policy_dir, _toml(setting, value))
        assert isinstance(result, PolicyError), (setting, value)
        assert f": {setting}: " in str(result), str(result)


_IMPOSSIBLE = {
    b"[windows]\nslice_seconds = 1e-9\n":
        "windows.slice_seconds: Input should be greater than or equal to 0.1 (got 1e-09)",
    b"[actions]\ncooldown_seconds = 1e400\n": "actions.cooldown_seconds: Input should be a finite number (got inf)",
    b"[kv]\nwatermark = true\n": "kv.watermark: Input should be a valid number (got true)",
    b"[acceptance]\nreduce_first = 1\n": "acceptance.reduce_first: Input should be a valid boolean (got 1)",
    b"[acceptance]\nconsecutive = 3.0\n": "acceptance.consecutive: Input should be a valid integer (got 3.0)",
    b'[baseline.pinned."*"]\nacceptance_length = 2.5\n':
        "baseline.pinned.*.[key]: Value error, '*' cannot name a bucket or cohort: '*' means every one in "
        "decision scopes, and '/' separates their parts (got '*')",
    b'[admission]\ncanary_cohort = "canary\\u001b[0m"\n':
        "admission.canary_cohort: Value error, 'canary\\x1b[0m' holds a control character, line separator or "
        "bidirectional override (got 'canary\\x1b[0m')",
}


@pytest.mark.parametrize("content", list(_IMPOSSIBLE))
def test_impossible_values_are_refused_with_the_setting_named(policy_dir, content):
    result = _load(policy_dir, content)
    assert isinstance(result, PolicyError)
    assert str(result) == f"policy file {policy_dir / 'policy.toml'}: {_IMPOSSIBLE[content]}"


def test_integers_stand_for_floats_and_the_bounds_admit_the_defaults(policy_dir):
    policy = _load(policy_dir, b"[actions]\ncooldown_seconds = 30\n[windows]\nslice_seconds = 0.1\n")
    assert isinstance(policy, Policy) and policy.actions.cooldown_seconds == 30.0
    assert Policy.model_validate_json(Policy().model_dump_json()) == Policy()
