"""Wrappers around the vLLM V1 methods the collector observes, installed once per process.

vLLM times neither drafts nor the target forward and has no per-request fallback switch.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from .taps import RunnerTap, SchedulerTap, cut_drafts

__all__ = ["install", "wrap_classes", "TESTED_VLLM", "RUNNER_ATTR", "SCHEDULER_ATTR"]

_LOG = logging.getLogger(__name__)

# The wrapped signatures below are those of this vLLM release line; other versions are
# attempted with a warning, since these private methods move between releases.
TESTED_VLLM = "0.32."
_DEFAULT_SHUTDOWN_FLUSH_S = 5.0
RUNNER_ATTR = "_specwatch_runner"
SCHEDULER_ATTR = "_specwatch_scheduler"
_WRAPPED = "__specwatch_wrapped__"


def install(collector_for: Callable[[str], Any]) -> None:
    """Wrap GPUModelRunner (the CPU runner subclasses it) and Scheduler methods; idempotent.

    ``collector_for(role)`` returns the collector a newly built runner ("runner") or scheduler
    ("scheduler") binds to, or None to leave it untapped.
    """
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not str(vllm.__version__).startswith(TESTED_VLLM):
        _LOG.warning("specwatch's vLLM hooks were written for vLLM %sx, this is %s: telemetry "
                     "or fallback may be incomplete", TESTED_VLLM, vllm.__version__)
    wrap_classes(GPUModelRunner, Scheduler, collector_for, where=f"vLLM {vllm.__version__}")


def wrap_classes(runner_cls: type, scheduler_cls: type, collector_for: Callable[[str], Any],
                 where: str = "vLLM") -> None:
    """Wrap the hooked methods of a model runner class and a scheduler class; idempotent.

    `install` passes vLLM's own classes; the collector's hook-path benchmark passes
    stand-ins with the same methods, so both run exactly these wrappers.
    """
    runner_hooks = {
        "__init__": _init(collector_for, "runner", RUNNER_ATTR,
                          lambda runner, c: RunnerTap(c, runner.vllm_config, runner.device)),
        "execute_model": _execute_model,
        "_model_forward": _model_forward,
        "_input_fits_in_drafter": _input_fits_in_drafter,
        "propose_draft_token_ids": _propose_draft_token_ids,
        "sample_tokens": _sample_tokens,
        "take_draft_token_ids": _take_draft_token_ids,
    }
    scheduler_hooks = {
        "__init__": _init(collector_for, "scheduler", SCHEDULER_ATTR,
                          lambda scheduler, c: SchedulerTap(c, scheduler.vllm_config)
                          if c.sink is not None else None),
        "add_request": _before("add_request", lambda tap, request, *_: tap.on_add(request)),
        "update_from_output": _update_from_output,
        "make_spec_decoding_stats": _make_spec_decoding_stats,
        # Every way out of the scheduler (stop, length, abort, error) passes here while the
        # request still holds its tokens, times and parameters.
        "_free_request": _before("_free_request", lambda tap, request, *_: tap.on_finished(request)),
        # The engine is going away (and with a separate engine process, the process too): records
        # still queued for the sink are handed over first, within a bounded wait.
        "shutdown": _before("shutdown", lambda tap, *_: tap.collector.flush(_DEFAULT_SHUTDOWN_FLUSH_S)),
    }
    for cls, hooks in ((runner_cls, runner_hooks), (scheduler_cls, scheduler_hooks)):
        for name, make in hooks.items():
            original = cls.__dict__.get(name)
            if original is None:
                _LOG.warning("%s has no %s.%s: that part of specwatch's telemetry is off",
                             where, cls.__name__, name)
                continue
            if getattr(original, _WRAPPED, False):
                continue
            wrapper = functools.wraps(original)(make(original))
            setattr(wrapper, _WRAPPED, True)
            setattr(cls, name, wrapper)


def _init(collector_for: Callable[[str], Any], role: str, attr: str,
          new_tap: Callable[[Any, Any], Any]):
    """A runner's or scheduler's ``__init__`` that binds a speculative engine's part to a tap."""
    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            tap = None
            if self.vllm_config.speculative_config is not None:
                collector = collector_for(role)
                if collector is not None:
                    try:
                        tap = new_tap(self, collector)
                    except Exception as error:
                        collector.hook_failed(f"{role} init", error)
            setattr(self, attr, tap)
        return __init__
    return make


def _execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is None:
            return original(self, scheduler_output, *args, **kwargs)
        try:
            tap.open_frame(scheduler_output)
        except Exception as error:
            tap.collector.hook_failed("execute_model", error)
        result = original(self, scheduler_output, *args, **kwargs)
        if result is not None:
            # Outputs returned here (empty batches, pooling, pipeline stages) never reach
            # sample_tokens; some are shared singletons that must not carry a frame.
            tap.frame = None
        return result
    return execute_model


def _model_forward(original):
    # The runner calls _model_forward exactly for the target model's forward pass (drafters
    # call their own model), which in a speculative step verifies the previous drafts.
    def _model_forward(self, *args, **kwargs):
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is None or tap.frame is None:
            return original(self, *args, **kwargs)
        begin = tap.start_timer()
        try:
            return original(self, *args, **kwargs)
        finally:
            tap.stop_timer(begin, is_draft=False)
    return _model_forward


def _input_fits_in_drafter(original):
    # sample_tokens asks this once per step, before any drafting, and when it answers False
    # vLLM takes its own no-draft path: the drafter does not run and the step's drafts are
    # zeros, which take_draft_token_ids below turns into empty lists. That makes it the place
    # to consult the flags for the whole batch, and to skip the drafter when all of it is off.
    def _input_fits_in_drafter(self, *args, **kwargs):
        fits = original(self, *args, **kwargs)
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is None or tap.frame is None:
            return fits
        try:
            req_ids = list(self.input_batch.req_ids)
            gated = tap.gate(req_ids, self.requests)
            if fits and gated and len(gated) == len(req_ids) and not any(gated.values()):
                tap.drafter_skipped(req_ids)
                return False
        except Exception as error:
            tap.collector.hook_failed("_input_fits_in_drafter", error)
        return fits
    return _input_fits_in_drafter


def _propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is None or tap.frame is None:
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        begin = tap.start_timer()
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        tap.stop_timer(begin, is_draft=True)
        gated = tap.pending_gate
        if gated and isinstance(drafts, list):
            # per-request lists (ngram, suffix): cut right here; a [num_reqs, k] tensor cannot
            # hold rows of different lengths and is cut when the engine takes it as lists
            drafts = cut_drafts(list(self.input_batch.req_ids), drafts, gated)
        return drafts
    return propose_draft_token_ids


def _take_draft_token_ids(original):
    def take_draft_token_ids(self):
        drafts = original(self)
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is None or drafts is None or not tap.pending_gate:
            return drafts
        gated, tap.pending_gate = tap.pending_gate, None
        try:
            return type(drafts)(list(drafts.req_ids),
                                cut_drafts(drafts.req_ids, drafts.draft_token_ids, gated))
        except Exception as error:
            tap.collector.hook_failed("take_draft_token_ids", error)
            return drafts
    return take_draft_token_ids


def _sample_tokens(original):
    def sample_tokens(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        tap: RunnerTap | None = getattr(self, RUNNER_ATTR, None)
        if tap is not None and tap.frame is not None:
            try:
                tap.close_frame(output)
            except Exception as error:
                tap.collector.hook_failed("sample_tokens", error)
        return output
    return sample_tokens


def _before(name: str, hand_over: Callable[..., Any]):
    """A scheduler hook that calls ``hand_over(tap, *args)`` (failures counted, never raised), then vLLM's method."""
    def make(original):
        def hooked(self, *args, **kwargs):
            tap: SchedulerTap | None = getattr(self, SCHEDULER_ATTR, None)
            if tap is not None:
                try:
                    hand_over(tap, *args)
                except Exception as error:
                    tap.collector.hook_failed(name, error)
            return original(self, *args, **kwargs)
        return hooked
    return make


def _update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        tap: SchedulerTap | None = getattr(self, SCHEDULER_ATTR, None)
        if tap is None:
            return original(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            tap.begin_step(scheduler_output, model_runner_output)
        except Exception as error:
            tap.collector.hook_failed("update_from_output", error)
        outputs = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            tap.end_step(self, scheduler_output, outputs)
        except Exception as error:
            tap.collector.hook_failed("update_from_output", error)
        return outputs
    return update_from_output


def _make_spec_decoding_stats(original):
    # vLLM calls this once per request that verified drafts in the step, with exactly the
    # numbers its own counters get: reading them here keeps specwatch's totals equal to vLLM's.
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        tap: SchedulerTap | None = getattr(self, SCHEDULER_ATTR, None)
        if tap is not None and num_draft_tokens:
            drafted = num_draft_tokens
            if num_invalid_spec_tokens:
                # drafts the grammar invalidated are not counted as drafted, as in vLLM
                drafted -= num_invalid_spec_tokens.get(request_id, 0)
            tap.on_round(request_id, drafted, num_accepted_tokens)
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)
    return make_spec_decoding_stats
