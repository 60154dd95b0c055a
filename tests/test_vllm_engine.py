"""The vLLM collector on a real engine: ngram speculation, fallback and restore, lossless text.

Run as a script (in a subprocess), this file drives vLLM and writes what it saw to JSON."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest

from vllm_scenario import (NGRAM_SPEC, PROMPTS, contract_records, flag_decision, flagged_collector,
                           measured_run, records_of_kind, rounds_matching_counters,
                           scenario_fixture, watched_engine)

pytestmark = pytest.mark.vllm

# (request id prefix, extra_args, expected bucket, expected cohort), one per prompt
_LABELS = [
    ("coding:canary:", None, "coding", "canary"),
    ("plain-", None, "default", "main"),
    ("x-", {"specwatch_bucket": "extraction", "specwatch_cohort": "baseline"}, "extraction", "baseline"),
    ("coding:canary:", {"specwatch_cohort": "shadow"}, "coding", "shadow"),
]
_MAX_TOKENS = 40
_DISABLE_AFTER_STEP = 5
_RESTORE_AFTER_STEP = 15
_TOGGLE_BLOCK = 4


def _scenario(out_path: Path) -> None:
    """Runs in the subprocess: every engine interaction of this module, results to JSON."""
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.engines.vllm.local_engine import close_engine, new_engine, run_to_completion
    from specwatch.schemas import encode_record
    from vllm import SamplingParams

    models = build_tiny_models()

    def requests(tag: str, max_tokens: int = _MAX_TOKENS):
        return [(f"{prefix}{tag}{i}", prompt,
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=7,
                                extra_args=dict(extra) if extra else None))
                for i, (prompt, (prefix, extra, _, _)) in enumerate(zip(PROMPTS, _LABELS))]

    def texts(run):
        return {rid: {"text": o.outputs[0].text, "tokens": list(o.outputs[0].token_ids),
                      "prompt_tokens": list(o.prompt_token_ids)} for rid, o in run.outputs.items()}

    collector, records, flags = flagged_collector("test-worker")
    result: dict = {"phases": {}}
    engine, bundle_id = watched_engine(collector, models.target, NGRAM_SPEC)
    result["bundle_id"] = bundle_id
    collector.flush()
    result["bundle_records"] = [encode_record(r) for r in records]

    def phase(name, reqs, on_step=None):
        run, measured = measured_run(engine, collector, records, reqs, on_step)
        result["phases"][name] = {**measured, "outputs": texts(run),
                                  "step_seconds": run.step_seconds}

    phase("speculative", requests("a"))

    marks: dict = {}

    def fallback(step: int) -> None:
        if step in (_DISABLE_AFTER_STEP, _RESTORE_AFTER_STEP):
            collector.flush()
            last_seq = max(r.seq for r in records if r.kind == "step")
            action = "disable_speculation" if step == _DISABLE_AFTER_STEP else "restore"
            flags.apply(flag_decision(bundle_id, action))
            marks[action] = last_seq

    phase("fallback", requests("b"), fallback)
    result["marks"] = marks

    # the collector switched on and off in alternating blocks of steps, requests in flight (its
    # cost, measured the same way, is `specwatch bench --section engine`)
    modes: list[bool] = []

    def toggle(step: int) -> None:
        modes.append(collector.enabled)
        collector.enabled = (step // _TOGGLE_BLOCK) % 2 == 1

    steps_before = collector.stats().steps
    run_to_completion(engine, requests("c", max_tokens=96), toggle)
    collector.enabled = True
    stats = collector.stats()
    result["toggled"] = {"steps": len(modes), "steps_on": modes.count(True),
                         "collector_steps": stats.steps - steps_before}
    result["stats"] = {k: getattr(stats, k) for k in stats.__dataclass_fields__}
    collector.close()
    close_engine(engine)

    engine = new_engine(models.target, None)
    result["standard"] = {"outputs": texts(run_to_completion(engine, requests("a")))}
    close_engine(engine)
    import vllm

    result["model_paths"] = {"target": str(models.target)}
    result["vllm_version"] = vllm.__version__
    out_path.write_text(json.dumps(result))


run = scenario_fixture(__file__)


def _steps(phase):
    return records_of_kind(phase["records"], "step")


def _requests(phase):
    return {r.id: r for r in contract_records(phase["records"]) if r.kind == "request"}


def _token_sha(ids) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def _external(internal_id: str) -> str:
    # vLLM appends "-<8 random chars>" to every request id it is given
    return internal_id.rsplit("-", 1)[0]


def test_totals_equal_vllm_counters(run):
    for name in ("speculative", "fallback"):
        rounds_matching_counters(run["phases"][name]["records"], run["phases"][name]["counters"])
    assert run["phases"]["speculative"]["counters"]["draft_tokens"] > 0, "ngram drafted nothing"


def test_step_records_follow_the_engine(run):
    steps = _steps(run["phases"]["speculative"])
    assert [s.seq for s in steps] == list(range(steps[0].seq, steps[0].seq + len(steps)))
    assert len(steps) == len(run["phases"]["speculative"]["step_seconds"])
    assert all(s.bundle_id == run["bundle_id"] and s.worker == "test-worker" for s in steps)
    assert all(s.verify_ms > 0 for s in steps), "every step runs the target forward"
    assert sum(s.draft_ms for s in steps) > 0
    assert all(0 < s.kv_usage <= 1 for s in steps[:-1])
    assert max(len(s.requests) for s in steps) == len(PROMPTS)
    assert all(e.accepted <= e.drafted <= NGRAM_SPEC["num_speculative_tokens"]
               for s in steps for e in s.requests)


def test_buckets_and_cohorts_from_request(run):
    expected = {f"{prefix}a{i}": (bucket, cohort) for i, (prefix, _, bucket, cohort) in enumerate(_LABELS)}
    for step in _steps(run["phases"]["speculative"]):
        for entry in step.requests:
            assert (entry.bucket, entry.cohort) == expected[_external(entry.id)]
    requests = _requests(run["phases"]["speculative"])
    assert {_external(r.id): (r.bucket, r.cohort) for r in requests.values()} == expected


def test_request_records(run):
    phase = run["phases"]["speculative"]
    requests = _requests(phase)
    assert len(requests) == len(PROMPTS)
    for internal_id, record in requests.items():
        output = phase["outputs"][_external(internal_id)]
        assert record.speculative and record.finish_reason == "length" and record.error is None
        assert record.output_tokens == _MAX_TOKENS == len(output["tokens"])
        assert 0 < record.ttft_ms <= record.e2e_ms
        assert record.tpot_ms is not None and record.tpot_ms > 0
        assert record.sample.output_sha256 == _token_sha(output["tokens"])
        assert record.sample.prompt_sha256 == _token_sha(output["prompt_tokens"])
        sampling = record.sample.sampling
        assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.max_tokens) == (0.0, 1.0, 7, _MAX_TOKENS)
    # a request's record follows the step record of the step it finished in, and no later
    # step carries it
    records = contract_records(phase["records"])
    for i, record in enumerate(records):
        if record.kind == "request":
            seen = [r for r in records[:i] if r.kind == "step" and record.id in {e.id for e in r.requests}]
            later = [r for r in records[i:] if r.kind == "step" and record.id in {e.id for e in r.requests}]
            assert seen and not later


def test_bundle_card_from_engine_config(run):
    from specwatch.collectors.vllm.bundle import checkpoint_revision, tokenizer_digest
    from specwatch.schemas import bundle_digest

    (bundle,) = contract_records(run["bundle_records"])
    assert bundle.kind == "bundle" and bundle.bundle_id == run["bundle_id"]
    card, target = bundle.card, run["model_paths"]["target"]
    assert card.target.model_id == target
    assert card.target.revision == checkpoint_revision(target) != ""
    assert card.target.tokenizer_digest == tokenizer_digest(target)
    assert card.target.quantization == "none/float32"
    assert (card.drafter.mechanism, card.drafter.draft_length) == ("ngram", 4)
    assert card.drafter.revision == "ngram:lookup=2-3"
    assert card.runtime.engine == f"vllm-{run['vllm_version']}" == "vllm-0.32.0"
    assert card.runtime.gpu.startswith("cpu") and card.runtime.parallelism == "tp1-pp1-dp1"
    assert card.policy.acceptance_rule == "strict"
    assert bundle_digest(card) == run["bundle_id"]


def test_fallback_removes_drafts_and_restore_brings_them_back(run):
    steps = _steps(run["phases"]["fallback"])
    disabled_at, restored_at = run["marks"]["disable_speculation"], run["marks"]["restore"]
    # the step right after the decision verifies drafts proposed before it; from the next
    # proposal on, the gate applies
    off = [s for s in steps if disabled_at + 1 < s.seq <= restored_at]
    assert off and all(e.drafted == 0 for s in off for e in s.requests)
    assert all(s.draft_ms < 1.0 for s in off), "the ngram drafter is not run while speculation is off"
    before = [s for s in steps if s.seq <= disabled_at]
    after = [s for s in steps if s.seq > restored_at + 1]
    assert sum(e.drafted for s in before for e in s.requests) > 0
    assert sum(e.drafted for s in after for e in s.requests) > 0, "restore did not bring drafts back"
    # requests that lived through the fallback are not clean speculative samples
    assert all(not r.speculative for r in _requests(run["phases"]["fallback"]).values())


def test_greedy_text_identical_on_off_and_after_fallback(run):
    def by_prompt(outputs):
        return {rid[-1]: o["text"] for rid, o in outputs.items()}

    speculative = by_prompt(run["phases"]["speculative"]["outputs"])
    fallback = by_prompt(run["phases"]["fallback"]["outputs"])
    standard = by_prompt(run["standard"]["outputs"])
    assert len(standard) == len(PROMPTS)
    assert speculative == fallback == standard


def test_a_switched_off_collector_counts_no_steps_and_nothing_is_lost(run):
    toggled = run["toggled"]
    assert 0 < toggled["collector_steps"] == toggled["steps_on"] < toggled["steps"]
    stats = run["stats"]
    assert stats["dropped"] == stats["rejected"] == stats["hook_errors"] == stats["untimed_steps"] == 0


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
