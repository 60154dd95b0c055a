"""Draft-model speculation on a real vLLM engine (a copy of the target, a random drafter): flags
cut or stop proposals per scope on the tensor-drafter path; greedy text never changes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from vllm_scenario import (drafted_rounds, flag_decision, flagged_collector, measured_run,
                           records_of_kind, rounds_matching_counters, scenario_fixture,
                           watched_engine)

pytestmark = pytest.mark.vllm

_DRAFT_LENGTH = 4
_PROMPTS = [
    "def area(radius):\n    return 3.14 * radius\n",
    "import json\n\nwith open('data.json') as f:\n",
    "for i in range(10):\n    print(i)\n",
    "Once upon a time there was a",
]
# request id prefixes (bucket:cohort:) for the prompts above
_PREFIXES = ["coding:canary:", "coding:main:", "chat:canary:", "chat:main:"]
_MAX_TOKENS = 24
_COPY_MAX_TOKENS = 40  # a copy drafter moves 5 tokens a step: more tokens, enough steps
_CUT_LIMIT = 2
# the random drafter's script: coding off, then everything off, then all restored with a new
# request arriving (after step N of the run)
_CODING_OFF_AFTER = 3
_ALL_OFF_AFTER = 8
_RESTORE_AFTER = 12
_LATE_ID = "chat:main:late"


def _scenario(out_path: Path) -> None:
    """Runs in the subprocess: copy drafter, random drafter, standard decoding; results to JSON."""
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.engines.vllm.local_engine import close_engine, new_engine, run_to_completion
    from vllm import SamplingParams

    models = build_tiny_models()

    def requests(tag, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [(f"{prefix}{tag}{i}", prompt, params)
                for i, (prefix, prompt) in enumerate(zip(_PREFIXES, _PROMPTS))]

    result: dict = {}

    def engine_run(name, drafter, max_tokens, script):
        """``script``: (after_step, mark, decision factories, request to add or None)."""
        collector, records, flags = flagged_collector(f"test-{name}")
        started = time.monotonic()
        spec = {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": _DRAFT_LENGTH}
        engine, bundle_id = watched_engine(collector, models.target, spec)
        init_s = time.monotonic() - started
        marks = {}

        def on_step(step):
            for after_step, mark, decisions, extra in script:
                if step == after_step:
                    collector.flush()
                    marks[mark] = max(r.seq for r in records if r.kind == "step")
                    for action, bucket, cohort, evidence in decisions:
                        flags.apply(flag_decision(bundle_id, action, bucket, cohort, **evidence))
                    if extra is not None:
                        engine.add_request(*extra)

        started = time.monotonic()
        run, measured = measured_run(engine, collector, records, requests(name[0], max_tokens),
                                     on_step)
        result[name] = {
            **measured,
            "texts": {rid[-1]: o.outputs[0].text for rid, o in run.outputs.items() if rid != _LATE_ID},
            "finished": sorted(run.outputs),
            "marks": marks, "init_s": init_s, "run_s": time.monotonic() - started,
            "steps": len(run.step_seconds),
            "draft_ms": sum(r.draft_ms for r in records if r.kind == "step"),
            "verify_ms": sum(r.verify_ms for r in records if r.kind == "step"),
        }
        collector.close()
        close_engine(engine)

    def decision(action, bucket=None, cohort=None, **evidence):
        return action, bucket, cohort, evidence

    engine_run("copy", models.copy_drafter, _COPY_MAX_TOKENS, [
        (2, "cut", [decision("reduce_draft_length", "coding", "canary", draft_length=_CUT_LIMIT)], None)])
    late = (_LATE_ID, _PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine_run("random", models.random_drafter, _MAX_TOKENS, [
        (_CODING_OFF_AFTER, "coding_off", [decision("disable_speculation", "coding")], None),
        (_ALL_OFF_AFTER, "all_off", [decision("disable_speculation")], None),
        (_RESTORE_AFTER, "restored", [decision("restore"), decision("restore", "coding")], late),
    ])
    engine = new_engine(models.target, None)
    result["standard"] = {}
    for max_tokens in (_MAX_TOKENS, _COPY_MAX_TOKENS):
        run = run_to_completion(engine, requests(f"s{max_tokens}-", max_tokens))
        result["standard"][str(max_tokens)] = {rid[-1]: o.outputs[0].text for rid, o in run.outputs.items()}
    close_engine(engine)
    out_path.write_text(json.dumps(result))


run = scenario_fixture(__file__)


def _steps(part):
    return records_of_kind(part["records"], "step")


@pytest.mark.parametrize("name", ["copy", "random"])
def test_totals_equal_vllm_counters(run, name):
    assert rounds_matching_counters(run[name]["records"], run[name]["counters"])


def test_copy_drafter_accepts_every_draft(run, capsys):
    rounds = drafted_rounds(run["copy"]["records"])
    assert rounds and all(e.accepted == e.drafted for e in rounds)
    drafted = sum(e.drafted for e in rounds)
    part = run["copy"]
    with capsys.disabled():
        print(f"\n[vllm copy drafter] acceptance {sum(e.accepted for e in rounds)}/{drafted} = 1.00 "
              f"over {len(rounds)} rounds; draft {part['draft_ms']:.0f} ms vs verify "
              f"{part['verify_ms']:.0f} ms over {part['steps']} steps")


def test_random_drafter_accepts_almost_nothing(run, capsys):
    rounds = drafted_rounds(run["random"]["records"])
    drafted, accepted = sum(e.drafted for e in rounds), sum(e.accepted for e in rounds)
    part = run["random"]
    with capsys.disabled():
        print(f"\n[vllm random drafter] acceptance {accepted}/{drafted} = {accepted / drafted:.3f} "
              f"over {len(rounds)} rounds; draft {part['draft_ms']:.0f} ms vs verify "
              f"{part['verify_ms']:.0f} ms over {part['steps']} steps; scenario {run['wall_s']:.0f} s")
    assert drafted >= 40 and accepted / drafted < 0.05


def test_draft_and_verify_time_are_measured(run):
    for name in ("copy", "random"):
        steps = {s.seq: s for s in _steps(run[name])}
        assert all(s.verify_ms > 0 for s in steps.values())
        # drafts verified in a step were proposed in the step before, by a drafter that runs a
        # forward pass per drafted position: that step's draft time is never zero
        proposing = [steps[seq - 1] for seq, s in steps.items()
                     if seq - 1 in steps and any(e.drafted for e in s.requests)]
        assert proposing and all(s.draft_ms > 0 for s in proposing)


def _window(part, start_mark, end_mark=None):
    """Entries of the steps proposed entirely under the flags set at ``start_mark``.

    The step right after a decision verifies drafts proposed before it; the window ends at the
    step after which the next decision was applied.
    """
    marks = part["marks"]
    low = marks[start_mark] + 1
    high = marks[end_mark] if end_mark else float("inf")
    return [s for s in _steps(part) if low < s.seq <= high]


def test_draft_limit_cuts_proposals_for_one_scope(run):
    later = [e for s in _window(run["copy"], "cut") for e in s.requests]
    cut = [e for e in later if (e.bucket, e.cohort) == ("coding", "canary")]
    others = [e for e in later if (e.bucket, e.cohort) != ("coding", "canary")]
    assert cut and all(e.drafted <= _CUT_LIMIT for e in cut)
    assert any(e.drafted == _CUT_LIMIT for e in cut)
    assert any(e.drafted == _DRAFT_LENGTH for e in others), "other scopes keep the full draft length"


def test_disable_stops_drafts_for_one_bucket(run):
    part = run["random"]
    window = _window(part, "coding_off", "all_off")
    entries = [e for s in window for e in s.requests]
    assert [e for e in entries if e.bucket == "coding"]
    assert all(e.drafted == 0 for e in entries if e.bucket == "coding")
    assert any(e.drafted > 0 for e in entries if e.bucket == "chat"), "other buckets keep speculating"
    assert all(s.draft_ms > 0 for s in window), "a mixed batch still runs the drafter"
    before = [e for s in _steps(part) if s.seq <= part["marks"]["coding_off"] for e in s.requests]
    assert any(e.drafted > 0 for e in before if e.bucket == "coding")


def test_disable_everywhere_skips_the_drafter(run):
    window = _window(run["random"], "all_off", "restored")
    assert window and all(e.drafted == 0 for s in window for e in s.requests)
    assert all(s.draft_ms == 0 for s in window), "with every request off the drafter must not run"


def test_restore_drafts_for_new_requests_only(run):
    after = _window(run["random"], "restored")
    late = [e for s in after for e in s.requests if e.id.startswith(_LATE_ID + "-")]
    old = [e for s in after for e in s.requests if not e.id.startswith(_LATE_ID + "-")]
    assert any(e.drafted > 0 for e in late), "a request arriving after restore speculates again"
    # requests whose drafter state missed the skipped steps never draft again
    assert old and all(e.drafted == 0 for e in old)
    assert _LATE_ID in run["random"]["finished"]


def test_greedy_text_identical_across_drafters_and_fallback(run):
    standard = run["standard"]
    assert len(standard[str(_MAX_TOKENS)]) == len(_PROMPTS)
    assert run["copy"]["texts"] == standard[str(_COPY_MAX_TOKENS)]
    assert run["random"]["texts"] == standard[str(_MAX_TOKENS)]


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
