"""`specwatch demo --engine vllm`: real vLLM speculative decoding on tiny models, watched live.

A copy-of-target drafter and a random one serve waves; the random one is switched off in the engine.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_vllm_demo", "vllm_demo_policy"]

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
# Each drafter serves waves until every scope of its bundle has been off for this many steps,
# or until its time and waves are up and its last decision has had that many steps under it
# (README.md, "demo --engine vllm").
_DEFAULT_STEPS_AFTER_DECISION = 8
_DEFAULT_CLEAN_PHASE_S = 12.0
_DEFAULT_CLEAN_PHASE_WAVES = 12
_DEFAULT_RANDOM_PHASE_S = 180.0
_PROGRESS_EVERY_S = 3.0
_DISABLING = ("disable_speculation", "invalidate_bundle")
_PATH_CHANGES = _DISABLING + ("reduce_draft_length",)

# The policy's minimums scaled to seconds, a pinned acceptance baseline of two tokens per round
# at D=4, and speedup and latency gates loose enough for a shared CPU (README.md explains why).
_DEMO_POLICY = {
    "windows": {"slice_seconds": 1.0, "lateness_seconds": 0.5},
    "baseline": {"learn_seconds": 2.0, "min_rounds": 50, "min_requests": 8,
                 "pinned": {bucket: {"acceptance_length": 2.0}
                            for bucket in sorted({prefix.split(":")[0] for prefix in _PREFIXES})}},
    "acceptance": {"window_slices": 3, "consecutive": 2, "min_rounds": 20, "min_requests": 2,
                   "max_window_slices": 30, "settle_seconds": 3.0},
    "speedup": {"min_speedup": 0.1},
    "latency": {"p99_factor": 10.0},
}


def vllm_demo_policy():
    """The policy `specwatch demo --engine vllm` judges its short tiny-model run by.

    >>> policy = vllm_demo_policy()
    >>> policy.baseline.pinned["coding"].acceptance_length, policy.acceptance.min_requests
    (2.0, 2)
    """
    from specwatch.schemas import Policy

    return Policy.model_validate(_DEMO_POLICY)


def run_vllm_demo(json_output: bool, workdir: Path,
                  on_record: Callable[[Any], list] | None = None, flags: Any = None,
                  finish: Callable[[], list] | None = None) -> dict:
    """Run the demo; returns a summary dict (and prints a report unless ``json_output``).

    ``json_output``: nothing on stdout (progress goes to stderr either way).
    ``workdir`` gets telemetry.jsonl and summary.json. ``on_record`` (``EmbeddedPipeline.feed``)
    gets every record on the emitter thread and returns decisions, applied to ``flags`` (default
    a new FlagStore); None: nothing decides. ``finish`` returns the decisions of the windows
    still open once the engines are closed.
    """
    from specwatch.engines.vllm.local_engine import (close_engine, configure_cpu_environment, new_engine,
                                                     quiet_vllm_logging, run_to_completion, spec_decode_counters)

    quiet_vllm_logging()
    from specwatch.actions.flags import FlagStore

    from specwatch.collectors.vllm.collector import VllmCollector
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
        for name, drafter, seconds, min_waves in (
                ("copy-drafter", models.copy_drafter, _DEFAULT_CLEAN_PHASE_S, _DEFAULT_CLEAN_PHASE_WAVES),
                ("random-drafter", models.random_drafter, _DEFAULT_RANDOM_PHASE_S, 0)):
            _progress(f"{name}: starting vLLM (draft model {drafter.name}, "
                      f"{_DRAFT_LENGTH} tokens per round)")
            spec = {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": _DRAFT_LENGTH}
            # one engine, one worker: a worker that changed its drafter in place would rightly
            # be read as a changed bundle rather than as a drafter that stopped paying
            collector = VllmCollector(feed, flags=flags, worker=f"demo-vllm-{name.split('-')[0]}")
            collectors.append(collector)
            with collector.watching():
                engine = new_engine(models.target, spec, max_num_seqs=len(_PROMPTS))
            (bundle_id,) = collector.bundles
            feed.start_phase(name, bundle_id)
            phase_start = time.monotonic()
            at_start = spec_decode_counters(engine)
            run = run_to_completion(engine, wave("w0"))
            texts[name] = {rid.rsplit("-", 1)[-1]: out.outputs[0].text for rid, out in run.outputs.items()}
            waves = 1
            # vLLM's own counters when every scope had been switched off, taken between waves
            # (no drafts in flight): whatever they gain later was drafted against the flags
            all_off = None
            next_report = phase_start + _PROGRESS_EVERY_S
            while not (all_off is not None and waves > all_off[0]
                       and feed.fallback_held(_DEFAULT_STEPS_AFTER_DECISION)):
                # Time up ends a phase only once every decision its waves brought has engine
                # steps under it: on a loaded machine the decisions can land in its last wave.
                if (time.monotonic() - phase_start >= seconds and waves >= min_waves and collector.flush()
                        and feed.changes_followed(_DEFAULT_STEPS_AFTER_DECISION)
                        and (all_off is not None or not feed.all_off())):
                    break
                if all_off is None and feed.all_off():
                    all_off = (waves, spec_decode_counters(engine))
                run_to_completion(engine, wave(f"w{waves}"))
                waves += 1
                if time.monotonic() >= next_report:
                    next_report += _PROGRESS_EVERY_S
                    _progress(f"{name}: {feed.progress()}")
            collector.close()
            at_end = spec_decode_counters(engine)
            close_engine(engine)
            phase = feed.end_phase(waves, time.monotonic() - phase_start)
            phase["vllm_counters"] = {k: at_end[k] - at_start[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
            if all_off is not None:
                phase["waves_after_all_off"] = waves - all_off[0]
                phase["vllm_draft_tokens_after_all_off"] = at_end["draft_tokens"] - all_off[1]["draft_tokens"]
            phases.append(phase)
            _progress(f"{name}: done, {phase['steps']} steps, acceptance {_number(phase['acceptance'], 3)}")
    finally:
        for collector in collectors:
            collector.close()
        feed.close()
    late = list(finish() or []) if finish is not None else []
    for decision in late:
        flags.apply(decision)
    stats = [c.stats() for c in collectors]
    steps = sum(s.steps for s in stats)
    decisions = feed.decisions + late
    random_phase = phases[-1] if phases else {}
    summary = {
        "engine": "vllm",
        "models": str(models.root),
        "telemetry": str(workdir / "telemetry.jsonl"),
        "phases": phases,
        "decisions": [json.loads(d.to_json_line()) for d in decisions],
        "decision_ids": [d.id for d in decisions],
        "decided_by": "pipeline" if on_record is not None else "nothing (records only)",
        "fallback_took_effect": bool(_disables(random_phase)) and all(
            a["steps_after"] > 0 and a["drafted_after"] == 0 for a in _disables(random_phase))
        and random_phase.get("vllm_draft_tokens_after_all_off") == 0,
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
    """The demo's sink: writes every record, hands it to the pipeline, applies its decisions.

    Per phase (one engine, one bundle) it keeps the steps and the disable decisions on the
    bundle with the wall time each reached the flags, to tell which steps ran under them.
    """

    def __init__(self, path: Path, on_record: Callable[[Any], list] | None, flags: Any) -> None:
        from specwatch.schemas import encode_record

        self._encode = encode_record
        self._out = path.open("w")
        self._on_record = on_record
        self._flags = flags
        self._lock = threading.Lock()
        self.count = 0
        self.decisions: list = []
        self.start_phase(None, None)

    def start_phase(self, name: str | None, bundle_id: str | None) -> None:
        with self._lock:
            self.phase = name
            self.bundle_id = bundle_id
            self._steps: list = []
            self._requests: list = []
            self._scopes: set[tuple[str, str]] = set()
            # decisions that changed the bundle's path, with the wall time each reached the flags
            self._changes: list[tuple[Any, float]] = []

    def emit(self, record: Any) -> None:
        self._out.write(self._encode(record) + "\n")
        self.count += 1
        decisions = list(self._on_record(record) or []) if self._on_record is not None else []
        with self._lock:
            if record.bundle_id == self.bundle_id:
                if record.kind == "step":
                    self._steps.append(record)
                    self._scopes.update((e.bucket, e.cohort) for e in record.requests)
                elif record.kind == "request":
                    self._requests.append(record)
        for decision in decisions:
            self._apply(decision)

    def _apply(self, decision: Any) -> None:
        apply = getattr(self._flags, "apply", None)
        if apply is not None:
            apply(decision)
        with self._lock:
            self.decisions.append(decision)
            if decision.bundle_id == self.bundle_id and decision.action in _PATH_CHANGES:
                self._changes.append((decision, time.time()))
        _progress(f"decision {decision.action} ({decision.reason}, by {decision.detector}) for "
                  f"{decision.bundle_id}/{decision.bucket or '*'}/{decision.cohort or '*'}")

    def _in_flight(self, applied_at: float) -> int | None:
        """Seq of the step in flight when a decision reached the flags (None: no later step yet)."""
        return next((s.seq for s in self._steps if s.ts > applied_at), None)

    def _after(self, applied_at: float) -> list:
        # Records reach this sink a little after their step, so a decision is placed by time:
        # the step in flight may have proposed before the flag flipped and the one after it
        # verifies those drafts; every step after that is proposed under the new flags.
        in_flight = self._in_flight(applied_at)
        if in_flight is None:
            return []
        return [s for s in self._steps if s.seq > in_flight + 1]

    def _off(self) -> list[tuple[str, str]]:
        return sorted(s for s in self._scopes if not self._flags.lookup(self.bundle_id, *s).enabled)

    def all_off(self) -> bool:
        """Every scope the phase's bundle has served is switched off."""
        with self._lock:
            return bool(self._scopes) and len(self._off()) == len(self._scopes)

    def changes_followed(self, steps: int) -> bool:
        """The last path change of the phase (if any) has had ``steps`` engine steps proposed
        under it."""
        with self._lock:
            return not self._changes or len(self._after(max(at for _, at in self._changes))) >= steps

    def fallback_held(self, steps: int) -> bool:
        """Every scope of the phase's bundle is off, and has been for ``steps`` engine steps."""
        with self._lock:
            if not self._changes or len(self._off()) < len(self._scopes):
                return False
            return len(self._after(max(at for _, at in self._changes))) >= steps

    def progress(self) -> str:
        with self._lock:
            drafted, accepted = _totals(self._steps)
            return (f"{len(self._steps)} steps, acceptance {_ratio(accepted, drafted):.3f}, "
                    f"scopes off: {len(self._off())}/{len(self._scopes)}")

    def end_phase(self, waves: int, seconds: float) -> dict:
        with self._lock:
            steps = self._steps
            drafted, accepted = _totals(steps)
            start = steps[0].ts if steps else math.nan
            speculative = [r.tpot_ms for r in self._requests if r.speculative and r.tpot_ms is not None]
            standard = [r.tpot_ms for r in self._requests if not r.speculative and r.tpot_ms is not None]
            summary = {
                "name": self.phase,
                "bundle_id": self.bundle_id,
                "waves": waves,
                "steps": len(steps),
                "requests": len(self._requests),
                "scopes": [f"{b}/{c}" for b, c in sorted(self._scopes)],
                "scope_rounds": {f"{b}/{c}": sum(1 for s in steps for e in s.requests
                                                 if e.drafted and (e.bucket, e.cohort) == (b, c))
                                 for b, c in sorted(self._scopes)},
                "scope_requests": {f"{b}/{c}": sum(1 for r in self._requests if (r.bucket, r.cohort) == (b, c))
                                   for b, c in sorted(self._scopes)},
                "drafted": drafted,
                "accepted": accepted,
                # None where undefined (no drafts, no requests of that kind): the summary is JSON
                "acceptance": _defined(_ratio(accepted, drafted), 4),
                "draft_ms_per_step": _defined(_mean([s.draft_ms for s in steps]), 3),
                "verify_ms_per_step": _defined(_mean([s.verify_ms for s in steps]), 3),
                "estimated_speedup": _defined(_estimated_speedup(steps), 3),
                "tpot_ms_speculative": _defined(_mean(speculative), 3),
                "tpot_ms_standard": _defined(_mean(standard), 3),
                "event_seconds": round(steps[-1].ts - start, 3) if steps else 0.0,
                "seconds": round(seconds, 1),
                "actions": [],
            }
            for i, (decision, applied_at) in enumerate(self._changes):
                in_flight = self._in_flight(applied_at)
                # under this decision: from the first step proposed after it to the step in
                # flight when the next change of the same scope arrived
                until = next((self._in_flight(at) for later, at in self._changes[i + 1:]
                              if _covers(later, decision)), None)
                after = [s for s in self._after(applied_at) if until is None or s.seq <= until]
                in_scope = [e for s in after for e in s.requests if _covers(decision, e)]
                before = [s for s in steps if s.ts <= decision.ts]
                summary["actions"].append({
                    "decision_id": decision.id,
                    **{name: getattr(decision, name) for name in ("action", "reason", "detector")},
                    "scope": f"{decision.bucket or '*'}/{decision.cohort or '*'}",
                    **{key: decision.evidence.get(key)
                       for key in ("draft_length", "metric", "value", "threshold")},
                    "after_event_seconds": round(decision.ts - start, 3),
                    "after_steps": len(before),
                    "rounds_before": sum(1 for s in before for e in s.requests
                                         if e.drafted and _covers(decision, e)),
                    "in_flight_step": in_flight,
                    "steps_after": len(after),
                    "entries_after": len(in_scope),
                    "drafted_after": sum(e.drafted for e in in_scope),
                    "max_drafted_after": max((e.drafted for e in in_scope), default=None),
                })
            return summary

    def close(self) -> None:
        self._out.close()


def _covers(decision: Any, entry: Any) -> bool:
    """Whether a decision's scope covers a step entry (or the scope of another decision)."""
    return decision.bucket in (None, entry.bucket) and decision.cohort in (None, entry.cohort)


def _disables(phase: dict) -> list[dict]:
    return [a for a in phase.get("actions", ()) if a["action"] in _DISABLING]


def _estimated_speedup(steps: list) -> float:
    """The speedup gate's estimate over the steps that drafted (the detectors' formula)."""
    from specwatch.schemas.slice_stats import SliceStats

    stats = SliceStats()
    for step in steps:
        rounds = [e for e in step.requests if e.drafted]
        if rounds:
            for entry in rounds:
                stats.add_round(entry.drafted, entry.accepted)
            stats.add_step_time(step.draft_ms, step.verify_ms, step.kv_usage, step.ts)
    return stats.speedup


def _totals(steps: list) -> tuple[int, int]:
    drafted = sum(e.drafted for s in steps for e in s.requests)
    accepted = sum(e.accepted for s in steps for e in s.requests)
    return drafted, accepted


def _ratio(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else float("nan")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _defined(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _progress(message: str) -> None:
    print(f"[vllm demo] {message}", file=sys.stderr, flush=True)


def _print_report(summary: dict) -> None:
    print("specwatch demo on vLLM (tiny random-weight Llama, CPU)")
    names = {}
    for phase in summary["phases"]:
        names[phase["bundle_id"]] = phase["name"]
        print(f"  {phase['name']:<15} bundle {phase['bundle_id']}  {phase['steps']:>4} steps in "
              f"{phase['event_seconds']:.1f} s  acceptance {phase['accepted']}/{phase['drafted']} = "
              f"{_number(phase['acceptance'], 3)}  draft {_number(phase['draft_ms_per_step'], 2)} ms/step  "
              f"verify {_number(phase['verify_ms_per_step'], 2)} ms/step")
        standard = (f", {phase['tpot_ms_standard']:.2f} ms on standard decoding"
                    if phase["tpot_ms_standard"] is not None else "")
        print(f"    estimated speedup {_number(phase['estimated_speedup'], 2)} while drafting; TPOT "
              f"{_number(phase['tpot_ms_speculative'], 2)} ms speculative{standard}")
        if not phase["actions"]:
            print(f"    no change: all {len(phase['scopes'])} scopes kept speculating at full draft length")
        if "waves_after_all_off" in phase:
            print(f"    every scope off: the next {phase['waves_after_all_off']} waves drafted "
                  f"{phase['vllm_draft_tokens_after_all_off']} tokens by vLLM's own counters")
        for a in phase["actions"]:
            if a["action"] == "reduce_draft_length":
                what = f"{a['action']} to D={a['draft_length']}"
                effect = f"at most {a['max_drafted_after']} tokens per request"
            else:
                what, effect = a["action"], f"{a['drafted_after']} tokens"
            print(f"    at {a['after_event_seconds']:5.1f} s: {what} {a['scope']}, {a['reason']} "
                  f"({a['metric']} {a['value']} < {a['threshold']}); {a['steps_after']} later steps drafted "
                  f"{effect} in scope")
    print(f"  decisions ({len(summary['decisions'])}):")
    for d, ident in zip(summary["decisions"], summary["decision_ids"]):
        print(f"    {ident}  {names.get(d['bundle_id'], d['bundle_id']):<15} {d['bucket'] or '*'}/{d['cohort'] or '*'}"
              f"  {d['action']}  {d['reason']} ({d['detector']})")
    print(f"  decided by: {summary['decided_by']}; fallback took effect: {summary['fallback_took_effect']}")
    print(f"  greedy text identical with both drafters (lossless): {summary['lossless']}")
    print(f"  collector cost {summary['collector']['cost_us_per_step']} us/step, "
          f"{summary['records']} records in {summary['telemetry']}, {summary['seconds']} s")
