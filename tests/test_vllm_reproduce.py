"""`specwatch reproduce` on the tiny vLLM models, from sealed capture to verdicts: greedy requests,
sampled ones whose output differs from standard (a shadow check saw it), refused keys, bundles."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specwatch.analysis.reproduce import render_result
from vllm_scenario import scenario_fixture, watched_engine
from machine import specwatch

pytestmark = pytest.mark.vllm

_DRAFT_LENGTH = 4
_PROMPTS = [
    "def mean(values):\n    return sum(values) / len(values)\n",
    "import logging\n\nlog = logging.getLogger(__name__)\n",
    "class Stack:\n    def push(self, item):\n",
    "for key, value in sorted(table.items()):\n",
]
_GREEDY_TOKENS = 24
_SAMPLED_TOKENS = 16
_TEMPERATURE = 0.8
_TOP_P = 0.95
_SEED_BASE = 100
_GREEDY, _SAMPLED = "coding", "extraction"  # pinned at 2 tokens per round by the demo policy
_PHASE_LIMIT_S = 150.0
_SUBPROCESS_TIMEOUT_S = 1200


def _scenario(out_path: Path) -> None:
    """Runs in the subprocess: both phases through the pipeline into the archive; facts to JSON."""
    from vllm import SamplingParams

    from specwatch.archive.store import Archive
    from specwatch.archive.sink import ArchiveSink
    from specwatch.collectors.capture import SampleCapture
    from specwatch.collectors.vllm import VllmCollector
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.lab.demo.vllm_demo import vllm_demo_policy
    from specwatch.engines.vllm.local_engine import close_engine, new_engine, run_to_completion
    from specwatch.schemas import ShadowRecord
    from specwatch.schemas.policy import CapturePolicy
    from specwatch.schemas.sealed import SampleKey
    from specwatch.streams.embedded import EmbeddedPipeline

    out_dir = out_path.parent
    key_file = out_dir / "sample.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    key = SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": str(key_file)})
    policy = vllm_demo_policy()
    policy = policy.model_copy(update={"capture": CapturePolicy(enabled=True, rate=1.0)})
    dsn = f"chdb://{out_dir}/archive"
    archive = Archive.open(dsn)
    sink = ArchiveSink(archive)
    pipeline = EmbeddedPipeline(policy, clock=time.time, sinks=[sink])

    models = build_tiny_models()
    result: dict = {"archive": dsn, "key_file": str(key_file), "key_id": key.key_id, "target": str(models.target),
                    "shadow": {}}

    def sampled(i):
        return SamplingParams(temperature=_TEMPERATURE, top_p=_TOP_P, seed=_SEED_BASE + i,
                              max_tokens=_SAMPLED_TOKENS, ignore_eos=True)

    # the shadow check's reference: the sampled requests on the target with standard decoding
    engine = new_engine(models.target, None, max_num_seqs=len(_PROMPTS))
    reference = run_to_completion(engine, [(f"reference-{i}", p, sampled(i)) for i, p in enumerate(_PROMPTS)])
    close_engine(engine)
    standard = [list(reference.outputs[f"reference-{i}"].outputs[0].token_ids) for i in range(len(_PROMPTS))]

    collector = VllmCollector(SimpleNamespace(emit=pipeline.feed), worker="reproduce-test",
                              capture=SampleCapture(policy.capture, key))
    spec = {"method": "draft_model", "model": str(models.random_drafter), "num_speculative_tokens": _DRAFT_LENGTH}
    engine, bundle_id = watched_engine(collector, models.target, spec, max_num_seqs=len(_PROMPTS))
    result["bundle_id"] = bundle_id

    def decided(bucket):
        return [d for d in pipeline.decisions if d.bucket == bucket and d.reason == "acceptance_drop"]

    def shadow_check(outputs):
        for request_id, output in sorted(outputs.items()):
            tokens = list(output.outputs[0].token_ids)
            reference_ids = standard[int(request_id.rsplit("-", 1)[1])]
            result["shadow"][request_id] = next(
                (p for p, (a, b) in enumerate(zip(reference_ids, tokens)) if a != b), None)

    greedy = SamplingParams(temperature=0.0, max_tokens=_GREEDY_TOKENS, ignore_eos=True, seed=7)
    # the bad drafter on greedy requests, then on seeded sampled ones checked against standard decoding
    for bucket, params_for in ((_GREEDY, lambda i: greedy), (_SAMPLED, sampled)):
        started, wave = time.monotonic(), 0
        while not decided(bucket) and time.monotonic() - started < _PHASE_LIMIT_S:
            run = run_to_completion(engine, [(f"{bucket}:main:w{wave}-{i}", prompt, params_for(i))
                                             for i, prompt in enumerate(_PROMPTS)])
            collector.flush()
            if bucket == _SAMPLED:
                shadow_check(run.outputs)
            wave += 1
        result[bucket] = {"waves": wave}
    # Shadow verdicts arrive after the requests they check (here: after the acceptance decision,
    # which a strict mismatch's disable would otherwise pre-empt).
    for request_id, position in sorted(result["shadow"].items()):
        pipeline.feed(ShadowRecord(v=1, ts=time.time(), bundle_id=bundle_id, id=request_id, bucket=_SAMPLED,
                                   check="token_exact", match=position is None))
    result["sealed"] = collector.capture.stats().sealed
    collector.close()
    close_engine(engine)
    pipeline.finish()
    sink.close()
    archive.close()
    result["decisions"] = [{"id": d.id, "bucket": d.bucket, "action": d.action, "reason": d.reason,
                            "sample_ids": list(d.sample_ids)} for d in pipeline.decisions]
    out_path.write_text(json.dumps(result))


scenario = scenario_fixture(__file__, _SUBPROCESS_TIMEOUT_S, name="scenario")


def _reproduce(scenario, decision_id, *extra, key_file="scenario"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECWATCH_SAMPLE_KEY")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if key_file is not None:
        env["SPECWATCH_SAMPLE_KEY_FILE"] = scenario["key_file"] if key_file == "scenario" else str(key_file)
    return specwatch("reproduce", decision_id, "--archive", scenario["archive"], "--actor", "postmortem-test", *extra,
                     timeout=_SUBPROCESS_TIMEOUT_S, env=env)


def _reproduced(scenario, decision_id) -> dict:
    """What `specwatch reproduce --json` says of ``decision_id`` (it must exit 0)."""
    done = _reproduce(scenario, decision_id, "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _decision(scenario, bucket):
    found = [d for d in scenario["decisions"] if d["bucket"] == bucket and d["reason"] == "acceptance_drop"]
    assert found, scenario["decisions"]
    return found[0]


def _archive_rows(scenario, decision_id):
    from specwatch.archive.store import Archive

    with Archive.open(scenario["archive"], create=False) as archive:
        return (archive.sealed_samples(decision_id), archive.audit(kind="sample_open"),
                archive.reproductions(decision_id))


def test_bad_drafter_reproduce_shows_low_acceptance_by_position(scenario, capsys):
    decision = _decision(scenario, _GREEDY)
    sealed, _, _ = _archive_rows(scenario, decision["id"])
    assert sealed and {row["key_id"] for row in sealed} == {scenario["key_id"]}
    assert {row["sample_id"] for row in sealed} <= set(decision["sample_ids"])
    result = _reproduced(scenario, decision["id"])
    assert result["verdict"] == "reproduced" and result["card_differences"] == []
    assert len(result["requests"]) == len(sealed)
    for report in result["requests"]:
        # greedy decoding is lossless: both paths and the archive agree token for token
        assert report["verdict"] == "reproduced" and report["identical"] is True
        assert report["first_divergence"] is None and report["archived_vs_standard"] is None
        assert report["output_tokens"] == _GREEDY_TOKENS and report["drafted"] > 0
        # a random drafter: nothing accepted at any position
        assert report["accepted"] == 0
        assert report["position_acceptance"] == [0.0] * _DRAFT_LENGTH
        assert report["draft_ms"] > 0 and report["verify_ms"] > 0
    _, opens, runs = _archive_rows(scenario, decision["id"])
    assert [(o["actor"], o["detail"]["outcome"]) for o in opens if o["decision_id"] == decision["id"]] == [
        ("postmortem-test", "opened")]
    assert [r["reproduction_id"] for r in runs] == [result["reproduction_id"]]
    with capsys.disabled():
        print("\n[reproduce, bad drafter]\n" + render_result(result))


def test_divergence_found_where_the_shadow_check_saw_it(scenario, capsys):
    decision = _decision(scenario, _SAMPLED)
    shadows = scenario["shadow"]
    assert any(p is not None for p in shadows.values()), "sampled speculative output differs from standard"
    assert any(d["reason"] == "quality_regression" and d["bucket"] == _SAMPLED for d in scenario["decisions"])
    result = _reproduced(scenario, decision["id"])
    assert result["requests"]
    for report in result["requests"]:
        # vLLM's speculative sampling does not repeat a seeded request's tokens across batches
        # and engine histories (greedy decoding does), so the verdict may be either; it must
        # say whether the speculative re-run gave the archived output
        assert report["verdict"] == ("reproduced" if report["archived_vs_speculative"] is None else "not reproduced")
        # vLLM adds "-<8 hex>" of its own to each request id, which the records carry
        seen = shadows[report["sample_id"].rsplit("-", 1)[0]]
        assert report["first_divergence"] == seen and report["archived_vs_standard"] == seen, report
    assert any(r["first_divergence"] is not None for r in result["requests"])
    with capsys.disabled():
        print("\n[reproduce, divergence]\n" + render_result(result))


def test_wrong_or_missing_key_opens_nothing(scenario, tmp_path):
    decision = _decision(scenario, _GREEDY)
    wrong = tmp_path / "wrong.key"
    wrong.write_text(os.urandom(32).hex())
    wrong.chmod(0o600)  # a key file others can read is used with a warning first
    refused = _reproduce(scenario, decision["id"], key_file=wrong)
    assert refused.returncode == 3
    assert refused.stderr.startswith(f"specwatch reproduce: cannot open the samples of {decision['id']}: the sample "
                                     f"was sealed with key {scenario['key_id']} and the key given is k-")
    missing = _reproduce(scenario, decision["id"], key_file=None)
    assert missing.returncode == 3
    assert "no sample key: set SPECWATCH_SAMPLE_KEY_FILE" in missing.stderr
    assert wrong.read_text() not in refused.stderr + refused.stdout
    _, opens, runs = _archive_rows(scenario, decision["id"])
    refusals = [o for o in opens if o["decision_id"] == decision["id"] and o["detail"]["outcome"] == "refused"]
    assert len(refusals) == 2 and refusals[1]["detail"]["key_id"] is None
    assert all(r["reproduction_id"] for r in runs)  # only completed runs are archived


def test_fingerprint_mismatch_is_refused(scenario):
    decision = _decision(scenario, _GREEDY)
    _, _, before = _archive_rows(scenario, decision["id"])
    spec = json.dumps({"method": "draft_model", "model": str(Path(scenario["target"]).parent / "random-drafter"),
                       "num_speculative_tokens": 2})
    refused = _reproduce(scenario, decision["id"], "--speculative-config", spec)
    assert refused.returncode == 3
    assert ("the local engine's bundle differs from the decision's in drafter.draft_length; nothing was run"
            in refused.stderr)
    _, _, after = _archive_rows(scenario, decision["id"])
    assert after == before


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
