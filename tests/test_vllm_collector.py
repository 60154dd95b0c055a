"""The vLLM collector's pure parts, without an engine: labels, gating, emission, configuration."""

from __future__ import annotations

import doctest
import importlib
import threading

import pytest

from specwatch.actions.flags import FlagStore
from specwatch.collectors.vllm import VllmCollector, request_labels
from specwatch.collectors.vllm import plugin
from specwatch.collectors.vllm.collector import RequestPayload, StepPayload, token_digest
from specwatch.collectors.vllm.taps import RunnerTap, StepFrame
from specwatch.schemas import BundleCard, DrafterCard, TargetCard, bundle_digest

from machine import fresh_python
from vllm_scenario import ListSink, flag_decision

_CARD = BundleCard(target=TargetCard(model_id="tiny"), drafter=DrafterCard(mechanism="ngram", draft_length=4))
_BUNDLE = bundle_digest(_CARD)


@pytest.mark.parametrize("name", ["collectors.vllm.bundle", "collectors.vllm.collector", "collectors.vllm.taps",
                                  "lab.demo.vllm_demo", "engines.vllm.rerunner"])
def test_doctests(name):
    # the shared doctest runner skips these packages (they may import vLLM); these modules do not
    module = importlib.import_module(f"specwatch.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_package_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import specwatch.collectors.vllm as v, specwatch.lab.demo.vllm_demo, specwatch.lab.demo.tiny_models, "
            "specwatch.collectors.vllm.plugin, specwatch.collectors.vllm.hooks, specwatch.engines.vllm.server, "
            "specwatch.engines.vllm.rerunner\n"
            "print(sorted(v.__all__)[0])")
    fresh_python(code, timeout=120)


@pytest.mark.parametrize("request_id, extra, expected", [
    ("coding:canary:1", {"specwatch_bucket": "chat"}, ("chat", "canary")),
    ("r-1", {"specwatch_bucket": "chat", "specwatch_cohort": "baseline"}, ("chat", "baseline")),
    ("r-1", {"specwatch_bucket": "a/b", "specwatch_cohort": 3}, ("default", "main")),
    ("::1", None, ("default", "main")),
    ("https://x:80/a", None, ("default", "main")),
])
def test_request_labels(request_id, extra, expected):
    assert request_labels(request_id, extra) == expected


def test_labeler_comes_first_and_invalid_answers_fall_back():
    assert request_labels("coding:canary:1", None, lambda rid, extra: ("rag", "main")) == ("rag", "main")
    assert request_labels("coding:canary:1", None, lambda rid, extra: None) == ("coding", "canary")
    assert request_labels("coding:canary:1", None, lambda rid, extra: ("", "x")) == ("coding", "canary")


@pytest.mark.parametrize("kwargs, message", [
    ({"sink": object()}, "emit"),
    ({"sink": ListSink(), "flags": object()}, "lookup"),
    ({"sink": ListSink(), "queue_size": 0}, "queue_size"),
    ({"sink": ListSink(), "worker": "w" * 300}, "worker"),
])
def test_collector_rejects_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VllmCollector(**kwargs)


def _step(seq, entries, ts=100.0):
    """A step payload as the scheduler tap hands it over: ids, labels, rounds by id."""
    ids = [rid for rid, *_ in entries]
    labels = [(bucket, cohort) for _, bucket, cohort, _, _ in entries]
    rounds = {rid: (drafted, accepted) for rid, _, _, drafted, accepted in entries if drafted}
    return StepPayload("step", ts + seq, seq, _BUNDLE, 0.001, 0.010, 0.5, ids, labels, rounds)


def _request(rid, n_out=3, reason="length"):
    return RequestPayload("request", 105.0, _BUNDLE, rid, "coding", "main", True, 100.0, 100.2, 104.0, n_out, reason,
                          None, [1, 2, 3], [4, 5, 6], (0.0, 1.0, 7, n_out))


@pytest.fixture
def collected():
    """A collector named w1 on a `ListSink`, and the sink's records; closed after the test."""
    sink = ListSink()
    collector = VllmCollector(sink, worker="w1")
    yield collector, sink.records
    collector.close()


def test_payloads_become_contract_records_in_order(collected):
    collector, records = collected
    collector.submit(("bundle", 99.0, _BUNDLE, _CARD))
    collector.submit(_step(0, [("r1", "coding", "main", 4, 3)]))
    collector.submit(_request("r1"))
    assert collector.flush(5)
    bundle, step, request = records
    assert (bundle.kind, bundle.worker, bundle.card) == ("bundle", "w1", _CARD)
    assert (step.draft_ms, step.verify_ms, step.kv_usage) == pytest.approx((1.0, 10.0, 0.5))
    assert [(e.id, e.drafted, e.accepted) for e in step.requests] == [("r1", 4, 3)]
    assert request.ttft_ms == pytest.approx(200.0) and request.e2e_ms == pytest.approx(5000.0)
    assert request.tpot_ms == pytest.approx(1900.0)  # (104.0 - 100.2) s over 2 later tokens
    assert request.sample.output_sha256 == token_digest([4, 5, 6])
    assert request.sample.sampling.seed == 7
    stats = collector.stats()
    assert (stats.bundle_records, stats.step_records, stats.request_records) == (1, 1, 1)


def test_single_token_request_has_no_tpot_and_finish_reasons_map(collected):
    collector, records = collected
    collector.submit(_request("r1", n_out=1, reason="repetition"))
    collector.submit(_request("r2", reason="abort"))
    collector.flush(5)
    first, second = records
    assert first.tpot_ms is None and first.finish_reason == "stop"
    assert second.finish_reason == "abort"


def test_broken_payload_is_counted_not_emitted_and_emission_continues(collected):
    collector, records = collected
    collector.submit(_step(0, [("r1", "coding", "main", 2, 3)]))  # accepted > drafted
    collector.submit(_step(1, [("r1", "coding", "main", 3, 2)]))
    collector.flush(5)
    assert [r.seq for r in records] == [1]
    assert collector.stats().rejected == 1


def test_failing_sink_is_counted_and_does_not_stop_emission():
    failures = [RuntimeError("broker down")]

    class Flaky(ListSink):
        def emit(self, record):
            if failures:
                raise failures.pop()
            super().emit(record)

    sink = Flaky()
    collector = VllmCollector(sink)
    for seq in range(3):
        collector.submit(_step(seq, []))
    collector.flush(5)
    assert [r.seq for r in sink.records] == [1, 2]
    assert collector.stats().emit_errors == 1
    collector.close()


def test_full_queue_drops_and_counts_instead_of_blocking():
    release = threading.Event()

    class Slow(ListSink):
        def emit(self, record):
            release.wait(10)
            super().emit(record)

    sink = Slow()
    collector = VllmCollector(sink, queue_size=4)
    for seq in range(50):
        collector.submit(_step(seq, []))
    # The sink holds its first record until released: had submit waited for it, that wait
    # would have timed out and records would have reached the sink by now.
    assert sink.records == [], "submit must never wait for the sink"
    assert collector.stats().dropped >= 50 - 4 - 1
    release.set()
    collector.flush(10)
    stats = collector.stats()
    assert stats.dropped > 0 and stats.dropped + len(sink.records) == 50
    collector.close()


class _Config:
    """The few VllmConfig attributes a RunnerTap reads before it has a bundle."""

    class speculative_config:
        method = "draft_model"


class _State:
    def __init__(self, extra_args=None):
        self.sampling_params = type("P", (), {"extra_args": extra_args})()


def _tap(flags):
    tap = RunnerTap(VllmCollector(None, flags=flags), _Config(), device=None)
    tap._bundle_id = _BUNDLE
    tap.frame = StepFrame()
    return tap


def test_gate_follows_the_flags_per_request():
    flags = FlagStore()
    tap = _tap(flags)
    requests = {"coding:canary:1": _State(), "chat:main:2": _State(),
                "x": _State({"specwatch_bucket": "coding", "specwatch_cohort": "main"})}
    ids = list(requests)
    assert tap.gate(ids, requests) == {} and tap.pending_gate is None
    flags.apply(flag_decision(_BUNDLE, "disable_speculation", "coding"))
    assert tap.gate(ids, requests) == {"coding:canary:1": 0, "x": 0}
    flags.apply(flag_decision(_BUNDLE, "reduce_draft_length", "chat", draft_length=2))
    assert tap.gate(ids, requests) == {"coding:canary:1": 0, "chat:main:2": 2, "x": 0}
    assert tap.frame.gated == tap.pending_gate
    flags.apply(flag_decision(_BUNDLE, "restore", "coding"))
    assert tap.gate(ids, requests) == {"chat:main:2": 2}


def test_model_drafter_requests_stay_off_after_a_skipped_step():
    flags = FlagStore()
    tap = _tap(flags)
    requests = {"a": _State(), "b": _State()}
    flags.apply(flag_decision(_BUNDLE, "disable_speculation"))
    assert tap.gate(["a", "b"], requests) == {"a": 0, "b": 0}
    tap.drafter_skipped(["a", "b"])
    flags.apply(flag_decision(_BUNDLE, "restore"))
    requests["c"] = _State()
    assert tap.gate(["a", "b", "c"], requests) == {"a": 0, "b": 0}


def test_broken_flag_view_fails_open_and_is_counted():
    class Broken:
        def lookup(self, *args):
            raise ConnectionError("flag service unreachable")

    tap = _tap(Broken())
    assert tap.gate(["a"], {"a": _State()}) == {}
    assert tap.collector.stats().flag_errors == 1


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as a new process has it: nothing read from the environment, nothing watched."""
    monkeypatch.setattr(plugin, "_env_checked", False)
    monkeypatch.setattr(plugin, "_from_env", None)
    monkeypatch.setattr(plugin, "_watching", [])


def test_environment_configuration(monkeypatch, fresh_plugin):
    monkeypatch.setenv(plugin.ENV_SINK, f"{__name__}:ListSink")
    monkeypatch.setenv(plugin.ENV_FLAGS, "specwatch.actions.flags:FlagStore")
    monkeypatch.setenv(plugin.ENV_WORKER, "gpu-7")
    collector = plugin.collector_for("scheduler")
    assert collector is plugin.collector_for("runner")
    assert collector.worker == "gpu-7" and isinstance(collector.flags, FlagStore)
    collector.submit(_step(0, []))
    collector.flush(5)
    assert collector.sink._sink.records[0].seq == 0  # the sink was built on the first record
    collector.close()
    own = VllmCollector(ListSink())
    monkeypatch.setattr(plugin, "register", lambda: None)  # the real one wraps vLLM's classes
    with own.watching():
        assert plugin.collector_for("runner") is own
    assert plugin.collector_for("runner") is collector


@pytest.mark.parametrize("value, message", [
    ("nocolon", "package.module:callable"),
    ("specwatch.nowhere:thing", "cannot be loaded"),
    ("specwatch.collectors.vllm.collector:DEFAULT_BUCKET", "not callable"),
])
def test_environment_configuration_errors_say_what_to_fix(monkeypatch, fresh_plugin, value,
                                                          message):
    monkeypatch.setenv(plugin.ENV_SINK, value)
    with pytest.raises(ValueError, match=message):
        plugin.collector_for("scheduler")
