"""The advised draft length on a real vLLM engine with a drafter whose acceptance fades with
position: per-position counts equal vLLM's; `tune` advises D < 4; the engine drafts no further."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from vllm_scenario import (drafted_rounds, flagged_collector, measured_run, records_of_kind,
                           rounds_matching_counters, scenario_fixture, watched_engine)

pytestmark = pytest.mark.vllm

_DRAFT_LENGTH = 4
_NOISE = 0.05  # relative to each weight matrix's spread: about 2 in 3 greedy tokens agree
_NOISE_SEED = 7
_PROMPTS = [
    "def area(radius):\n    return 3.14 * radius\n",
    "import json\n\nwith open('data.json') as f:\n",
    "for i in range(10):\n    print(i)\n",
    "Once upon a time there was a",
    "class Cache:\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nfor name in os.listdir('.'):\n",
    "def parse(line):\n    return line.split(',')\n",
]
_MAX_TOKENS = 48


def _noisy_drafter(target: Path, out: Path) -> Path:
    """The target with seeded Gaussian noise on every weight matrix, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(_NOISE_SEED)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * _NOISE)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(target)).save_pretrained(out)
    return out


def _scenario(out_path: Path) -> None:
    """Runs in the subprocess: D=4, advice from the telemetry, the advised D, results to JSON."""
    from specwatch.lab.demo.tiny_models import build_tiny_models
    from specwatch.engines.vllm.local_engine import close_engine
    from specwatch.schemas import Decision
    from specwatch.analysis.tuning import tune_report
    from vllm import SamplingParams

    from telemetry_log import replayed

    models = build_tiny_models()
    drafter = _noisy_drafter(models.target, out_path.parent / "noisy-drafter")

    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, ignore_eos=True)
    collector, records, flags = flagged_collector("test-draft-length")
    spec = {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": _DRAFT_LENGTH}
    engine, bundle_id = watched_engine(collector, models.target, spec)
    card = collector.bundles[bundle_id].model_dump(mode="json")
    result: dict = {"bundle_id": bundle_id}

    def phase(name: str) -> None:
        started = time.monotonic()
        requests = [(f"coding:main:{name}{i}", p, params) for i, p in enumerate(_PROMPTS)]
        run, measured = measured_run(engine, collector, records, requests)
        result[name] = {
            **measured,
            "texts": {rid.rsplit(name, 1)[1]: o.outputs[0].text for rid, o in run.outputs.items()},
            "wall_s": time.monotonic() - started,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in run.outputs.values()),
        }

    def window_rows() -> list[dict]:
        rows: list[dict] = []
        replayed(records, sinks=[lambda output: rows.extend(output.window_rows)])
        return rows

    phase("full")
    report = tune_report(window_rows(), card, bundle_id, flags)
    result["report"] = report
    advised = next(b for b in report["buckets"] if b["bucket"] == "coding")["best_d"]
    flags.apply(Decision(ts=time.time(), bundle_id=bundle_id, bucket="coding", cohort=None,
                         action="reduce_draft_length", reason="acceptance_drop", detector="tune",
                         evidence={"draft_length": advised}))
    phase("advised")
    # with steps at two D, the cost model can separate the drafter's per-step cost from its passes
    result["report_both"] = tune_report(window_rows(), card, bundle_id, None,
                                        window_seconds=24 * 3600.0)
    collector.close()
    close_engine(engine)
    out_path.write_text(json.dumps(result))


run = scenario_fixture(__file__)


def _coding(report):
    return next(b for b in report["buckets"] if b["bucket"] == "coding")


def test_per_position_acceptance_equals_vllm_counters(run):
    for name in ("full", "advised"):
        assert rounds_matching_counters(run[name]["records"], run[name]["counters"])
    # and what tune read back from the pipeline's window stats is the same count
    coding = _coding(run["report"])
    full = drafted_rounds(run["full"]["records"])
    assert coding["rounds"] == len(full)
    assert coding["position_rates"] == pytest.approx(
        [a / len(full) for a in run["full"]["counters"]["accepted_per_pos"]], rel=1e-5)


def test_fading_drafter_gets_a_shorter_draft_and_the_engine_drafts_no_further(run, capsys):
    coding = _coding(run["report"])
    rates = coding["position_rates"]
    assert rates == sorted(rates, reverse=True) and rates[-1] < 0.5 * rates[0], "acceptance fades with position"
    assert coding["current_d"] == _DRAFT_LENGTH
    best = max(coding["curve"], key=lambda p: (p["speedup"], -p["d"]))
    advised = coding["best_d"]
    assert advised == best["d"] < _DRAFT_LENGTH
    later = drafted_rounds(run["advised"]["records"])
    assert later and max(e.drafted for e in later) == advised
    # positions the advised D keeps are accepted as the first run measured
    for k, (low, high) in enumerate(coding["position_intervals"][:advised], start=1):
        observed = sum(1 for e in later if e.accepted >= k) / len(later)
        assert low <= observed <= high, (k, observed, low, high)
    assert run["advised"]["texts"] == run["full"]["texts"]
    # step time: printed beside the model's prediction, never asserted (a shared CPU sets it)
    full_d, advised_d = coding["curve"][_DRAFT_LENGTH - 1], coding["curve"][advised - 1]
    predicted = (advised_d["draft_ms"] + advised_d["verify_ms"]) / (full_d["draft_ms"] + full_d["verify_ms"])
    measured, parts = {}, {}
    for name in ("full", "advised"):
        steps = records_of_kind(run[name]["records"], "step")
        measured[name] = sum(s.draft_ms + s.verify_ms for s in steps) / len(steps)
        parts[name] = (f"draft {sum(s.draft_ms for s in steps) / len(steps):.1f} + verify "
                       f"{sum(s.verify_ms for s in steps) / len(steps):.1f} ms")
    with capsys.disabled():
        print(f"\n[vllm draft length] rates {[round(r, 3) for r in rates]}; advised D {advised} "
              f"(predicted speedup {advised_d['speedup']:.3f} vs {full_d['speedup']:.3f} at D=4); step time "
              f"D=4 {parts['full']}, D={advised} {parts['advised']}: ratio "
              f"{measured['advised'] / measured['full']:.2f}, predicted {predicted:.2f}; output tokens/s "
              f"{run['full']['output_tokens'] / run['full']['wall_s']:.0f} -> "
              f"{run['advised']['output_tokens'] / run['advised']['wall_s']:.0f}")
        both = run["report_both"]
        refit = _coding(both)
        at = {p["d"]: p["draft_ms"] + p["verify_ms"] for p in refit["curve"]}
        cost = both["step_cost"]
        print(f"[vllm draft length] refit on both D: draft {cost['draft_fit']} (per step "
              f"{cost['draft_per_step']:.1f} ms, per pass {cost['draft_intercept']:.1f} + "
              f"{cost['draft_slope']:.2f} x requests ms), verify {cost['verify_fit']}; step time ratio "
              f"D={advised}/D=4 now predicted {at[advised] / at[_DRAFT_LENGTH]:.2f}; best D {refit['best_d']}")


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
