"""`specwatch demo --engine vllm`: real vLLM speculative decoding on tiny models, watched live.

A copy-of-target drafter accepts everything; a random one accepts nothing until a disable
decision reaches the engine and its steps stop carrying drafts, with greedy text unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_vllm_demo"]

_LOG = logging.getLogger(__name__)

_DRAFT_LENGTH = 4
# short requests: a pipeline judges windows by finished requests as well as by rounds
_MAX_TOKENS = 24
_PROMPTS = [
    "def mean(values):\n    return sum(values) / len(values)\n",
    "import logging\n\nlog = logging.getLogger(__name__)\n",
    "SELECT name, count(*) FROM users GROUP BY name",
    "Summarize: the meeting moved to Thursday because",
    "class Stack:\n    def push(self, item):\n",
    "Translate to French: good morning",
    "for key, value in sorted(table.items()):\n",
    "Extract the date: invoice issued on 2024-03-01 to",
]
# bucket:cohort: prefixes, one per prompt, so the telemetry has several scopes
_PREFIXES = ["coding:main:", "coding:canary:", "extraction:main:", "summarization:main:",
             "coding:main:", "chat:canary:", "coding:main:", "extraction:canary:"]
# The random-drafter phase runs until a disable decision has held for this many steps, or for
# at most this long (a pipeline needs some event time to judge a window).
_DEFAULT_STEPS_AFTER_DECISION = 8
_DEFAULT_RANDOM_PHASE_S = 90.0
# Without a pipeline the demo decides by itself, on the same evidence a pipeline gate reads:
# enough drafted tokens, acceptance far below what a working drafter gets.
_DEMO_RULE_MIN_DRAFTED = 96
_DEMO_RULE_MAX_ACCEPTANCE = 0.1
# vLLM logs to stdout by default, which must stay clean for --json; its CPU warnings (no
# tcmalloc/libiomp preload, ...) are noise in a demo.
_QUIET_ENVIRONMENT = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                      "TQDM_DISABLE": "1"}


def run_vllm_demo(json_output: bool, workdir: Path,
                  on_record: Callable[[Any], list] | None = None, flags: Any = None) -> dict:
    """Run the demo; returns a summary dict (and prints a report unless ``json_output``).

    Parameters
    ----------
    json_output
        True: print nothing on stdout (the caller prints the returned summary as JSON);
        progress always goes to stderr.
    workdir
        Where telemetry.jsonl (every record) and summary.json are written.
    on_record
        Called with every contract-v1 record, from the collector's emitter thread; returns the
        decisions it made, which are applied to ``flags``. None: records are only collected and
        a built-in acceptance rule makes the disable decision.
    flags
        Flag view the engine obeys (``lookup`` and ``apply``); default a new FlagStore.
    """
    for name, value in _QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from specwatch.actions.flags import FlagStore

    from .collector import VllmCollector
    from .local_engine import close_engine, configure_cpu_environment, new_engine, run_to_completion
    from .tiny_models import build_tiny_models

    configure_cpu_environment()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    flags = flags if flags is not None else FlagStore()
    started = time.monotonic()
    _progress("building tiny models (cached after the first run)")
    models = build_tiny_models()
    feed = _Feed(workdir / "telemetry.jsonl", on_record, flags)
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, ignore_eos=True, seed=7)

    def wave(tag: str) -> list[tuple[str, str, Any]]:
        return [(f"{prefix}{tag}-{i}", prompt, params)
                for i, (prefix, prompt) in enumerate(zip(_PREFIXES, _PROMPTS))]

    phases = []
    texts: dict[str, dict[str, str]] = {}
    collectors = []
    try:
        for name, drafter in (("copy-drafter", models.copy_drafter), ("random-drafter", models.random_drafter)):
            _progress(f"{name}: starting vLLM {_spec_label(drafter)}")
            spec = {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": _DRAFT_LENGTH}
            phase_start = time.monotonic()
            # one engine, one worker: a worker that changed its drafter in place would rightly
            # be read as a changed bundle rather than as a drafter that stopped paying
            collector = VllmCollector(feed, flags=flags, worker=f"demo-vllm-{name.split('-')[0]}")
            collectors.append(collector)
            with collector.watching():
                engine = new_engine(models.target, spec, max_num_seqs=len(_PROMPTS))
            (bundle_id,) = collector.bundles
            feed.start_phase(name, bundle_id, rule=on_record is None and name == "random-drafter")
            run = run_to_completion(engine, wave("w0"))
            texts[name] = {rid.rsplit("-", 1)[-1]: out.outputs[0].text for rid, out in run.outputs.items()}
            waves = 1
            if name == "random-drafter":
                deadline = phase_start + _DEFAULT_RANDOM_PHASE_S
                while time.monotonic() < deadline and not feed.decision_held(_DEFAULT_STEPS_AFTER_DECISION):
                    run_to_completion(engine, wave(f"w{waves}"))
                    waves += 1
                    drafted, accepted = feed.phase_totals()
                    _progress(f"{name}: {feed.phase_steps()} steps, acceptance "
                              f"{_ratio(accepted, drafted):.3f}, decision: "
                              f"{'in effect' if feed.has_decision else 'none yet'}")
            collector.close()
            close_engine(engine)
            phases.append(feed.end_phase(waves, time.monotonic() - phase_start))
            _progress(f"{name}: done, {phases[-1]['steps']} steps, acceptance {phases[-1]['acceptance']:.3f}")
    finally:
        for collector in collectors:
            collector.close()
        feed.close()
    stats = [c.stats() for c in collectors]
    steps = sum(s.steps for s in stats)
    summary = {
        "engine": "vllm",
        "models": str(models.root),
        "telemetry": str(workdir / "telemetry.jsonl"),
        "phases": phases,
        "decisions": [json.loads(d.to_json_line()) for d in feed.decisions],
        "decided_by": "demo rule" if on_record is None else "pipeline",
        "fallback_took_effect": bool(phases and phases[-1].get("drafted_after_decision") == 0
                                     and phases[-1].get("steps_after_decision", 0) > 0),
        "lossless": texts.get("copy-drafter") == texts.get("random-drafter"),
        "records": feed.count,
        "collector": {"steps": steps,
                      "cost_us_per_step": round(sum(s.cost_s for s in stats) / max(1, steps) * 1e6, 1),
                      "untimed_steps": sum(s.untimed_steps for s in stats),
                      "dropped": sum(s.dropped for s in stats),
                      "hook_errors": sum(s.hook_errors for s in stats)},
        "seconds": round(time.monotonic() - started, 1),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    if not json_output:
        _print_report(summary)
    return summary


class _Feed:
    """The demo's sink: writes every record, hands it to the pipeline, applies its decisions."""

    def __init__(self, path: Path, on_record: Callable[[Any], list] | None, flags: Any) -> None:
        from specwatch.schemas import encode_record

        self._encode = encode_record
        self._out = path.open("w")
        self._on_record = on_record
        self._flags = flags
        self._lock = threading.Lock()
        self.count = 0
        self.decisions: list = []
        self._reset(None, None, False)

    def _reset(self, name, bundle_id, rule) -> None:
        self.phase = name
        self.bundle_id = bundle_id
        self._rule = rule
        self._steps = []
        self._decision = None
        self._decision_at = 0.0  # wall time the disable decision reached the flags

    def start_phase(self, name: str, bundle_id: str, rule: bool) -> None:
        with self._lock:
            self._reset(name, bundle_id, rule)

    def emit(self, record: Any) -> None:
        self._out.write(self._encode(record) + "\n")
        self.count += 1
        decisions = list(self._on_record(record) or []) if self._on_record is not None else []
        with self._lock:
            if record.kind == "step" and record.bundle_id == self.bundle_id:
                self._steps.append(record)
            if self._rule and self._decision is None:
                decisions += self._demo_rule()
        for decision in decisions:
            self._apply(decision)

    def _demo_rule(self) -> list:
        from specwatch.schemas import Decision

        drafted, accepted = self.phase_totals_locked()
        if drafted < _DEMO_RULE_MIN_DRAFTED or _ratio(accepted, drafted) > _DEMO_RULE_MAX_ACCEPTANCE:
            return []
        return [Decision(ts=self._steps[-1].ts, bundle_id=self.bundle_id, action="disable_speculation",
                         reason="acceptance_drop", detector="demo_rule",
                         evidence={"drafted": drafted, "accepted": accepted,
                                   "acceptance": round(_ratio(accepted, drafted), 4)})]

    def _apply(self, decision: Any) -> None:
        apply = getattr(self._flags, "apply", None)
        if apply is not None:
            apply(decision)
        with self._lock:
            self.decisions.append(decision)
            if (decision.bundle_id == self.bundle_id and decision.action in
                    ("disable_speculation", "invalidate_bundle") and self._decision is None):
                self._decision = decision
                self._decision_at = time.time()
        _progress(f"decision {decision.action} ({decision.reason}, by {decision.detector}) for "
                  f"{decision.bundle_id}/{decision.bucket or '*'}/{decision.cohort or '*'}")

    def _in_scope(self, entry: Any) -> bool:
        d = self._decision
        return (d.bucket is None or d.bucket == entry.bucket) and (d.cohort is None or d.cohort == entry.cohort)

    @property
    def decision_step(self) -> int | None:
        """Seq of the step in flight when the disable decision reached the flags."""
        if self._decision is None:
            return None
        return next((s.seq for s in self._steps if s.ts > self._decision_at), None)

    def _after_decision(self) -> list:
        # Records reach this sink a little after their step, so the decision is placed by time:
        # the step in flight may have proposed before the flag flipped and the one after it
        # verifies those drafts; every step after that is proposed under the new flags.
        in_flight = self.decision_step
        if in_flight is None:
            return []
        return [s for s in self._steps if s.seq > in_flight + 1]

    @property
    def has_decision(self) -> bool:
        return self._decision is not None

    def decision_held(self, steps: int) -> bool:
        with self._lock:
            return len(self._after_decision()) >= steps

    def phase_steps(self) -> int:
        with self._lock:
            return len(self._steps)

    def phase_totals(self) -> tuple[int, int]:
        with self._lock:
            return self.phase_totals_locked()

    def phase_totals_locked(self) -> tuple[int, int]:
        drafted = sum(e.drafted for s in self._steps for e in s.requests)
        accepted = sum(e.accepted for s in self._steps for e in s.requests)
        return drafted, accepted

    def end_phase(self, waves: int, seconds: float) -> dict:
        with self._lock:
            steps = self._steps
            drafted, accepted = self.phase_totals_locked()
            summary = {
                "name": self.phase,
                "bundle_id": self.bundle_id,
                "waves": waves,
                "steps": len(steps),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": _ratio(accepted, drafted),
                "draft_ms_per_step": _mean([s.draft_ms for s in steps]),
                "verify_ms_per_step": _mean([s.verify_ms for s in steps]),
                "seconds": round(seconds, 1),
            }
            if self._decision is not None:
                after = self._after_decision()
                summary["decision"] = json.loads(self._decision.to_json_line())
                summary["decision_in_flight_step"] = self.decision_step
                summary["steps_after_decision"] = len(after)
                summary["drafted_after_decision"] = sum(e.drafted for s in after for e in s.requests
                                                        if self._in_scope(e))
                summary["draft_ms_per_step_after_decision"] = _mean([s.draft_ms for s in after])
            return summary

    def close(self) -> None:
        self._out.close()


def _ratio(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else float("nan")


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else float("nan")


def _spec_label(drafter: Path) -> str:
    return f"(draft model {drafter.name}, {_DRAFT_LENGTH} tokens per round)"


def _progress(message: str) -> None:
    print(f"[vllm demo] {message}", file=sys.stderr, flush=True)


def _print_report(summary: dict) -> None:
    print("specwatch demo on vLLM (tiny random-weight Llama, CPU)")
    for phase in summary["phases"]:
        print(f"  {phase['name']:<15} bundle {phase['bundle_id']}  steps {phase['steps']:>4}  "
              f"acceptance {phase['accepted']}/{phase['drafted']} = {phase['acceptance']:.3f}  "
              f"draft {phase['draft_ms_per_step']:.2f} ms/step  verify {phase['verify_ms_per_step']:.2f} ms/step")
        if "decision" in phase:
            d = phase["decision"]
            print(f"    decision: {d['action']} ({d['reason']}, {d['detector']}) during step "
                  f"{phase['decision_in_flight_step']}; {phase['steps_after_decision']} later steps carried "
                  f"{phase['drafted_after_decision']} drafted tokens, draft time "
                  f"{phase['draft_ms_per_step_after_decision']:.2f} ms/step")
    print(f"  decided by: {summary['decided_by']}; fallback took effect: {summary['fallback_took_effect']}")
    print(f"  greedy text identical with both drafters (lossless): {summary['lossless']}")
    print(f"  collector cost {summary['collector']['cost_us_per_step']} us/step, "
          f"{summary['records']} records in {summary['telemetry']}, {summary['seconds']} s")
