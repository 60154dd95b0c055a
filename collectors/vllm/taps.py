"""Engine-side state of the vLLM collector: one tap on the model runner, one on the scheduler.

The runner tap times and gates proposals; the scheduler tap makes steps and requests payloads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .collector import RequestPayload, StepPayload, VllmCollector, request_labels, split_step

__all__ = ["StepFrame", "RunnerTap", "SchedulerTap", "FRAME_ATTR", "cut_drafts"]

# Attribute put on vLLM's own ModelRunnerOutput. It is pickled when the worker is a separate
# process (multiprocess executors) and instance attributes survive pickling, so the step frame
# reaches the scheduler either way.
FRAME_ATTR = "_specwatch_frame"

_perf_ns = time.perf_counter_ns
_LOG = logging.getLogger(__name__)


@dataclass(slots=True)
class StepFrame:
    """What the model runner measured during one engine step (travels on ModelRunnerOutput)."""

    draft_ns: int = 0
    verify_ns: int = 0
    cost_ns: int = 0
    # request id -> draft limit applied to its proposal in this step (0: drafting off); None
    # until the gate ran. Neither container is built for a step that does not need it.
    gated: dict[str, int] | None = None
    # CUDA events (start, end, is_draft) resolved when the step's results reach the host
    events: list | None = None


class RunnerTap:
    """Per-model-runner state: the open step frame, request labels and the last draft gate."""

    def __init__(self, collector: VllmCollector, vllm_config: Any, device: Any) -> None:
        self.collector = collector
        self._vllm_config = vllm_config
        spec = vllm_config.speculative_config
        # ngram looks only at the tokens it is given: skipping it for a step loses nothing.
        # Model drafters (and suffix trees) build per-request state from every step they see,
        # so a request that lived through a skipped step would get drafts from a broken state.
        self.stateless_drafter = spec.method in ("ngram", "ngram_gpu")
        # requests whose drafter state missed a step: no drafts for the rest of their life
        self._stale: set[str] = set()
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._bundle_id: str | None = None
        self._labels: dict[str, tuple[str, str]] = {}
        self.frame: StepFrame | None = None
        # this step's gate, applied to the proposals and again when the engine takes them as
        # per-request lists (the only form in which tensor drafts can be cut)
        self.pending_gate: dict[str, int] | None = None

    def open_frame(self, scheduler_output: Any) -> None:
        self.pending_gate = None
        if not self.collector.enabled:
            self.frame = None
            return
        # Only hooks with per-request work time themselves: a clock read costs about as much
        # as the constant work of a hook.
        frame = self.frame = StepFrame()
        finished = scheduler_output.finished_req_ids
        if finished:
            start = _perf_ns()
            for request_id in finished:
                self._labels.pop(request_id, None)
                self._stale.discard(request_id)
            frame.cost_ns += _perf_ns() - start

    def close_frame(self, output: Any) -> None:
        frame, self.frame = self.frame, None
        if frame is None or output is None:
            return
        if frame.events:
            start = _perf_ns()
            for begin, end, is_draft in frame.events:
                elapsed_ns = int(begin.elapsed_time(end) * 1e6)
                if is_draft:
                    frame.draft_ns += elapsed_ns
                else:
                    frame.verify_ns += elapsed_ns
            frame.events = None
            frame.cost_ns += _perf_ns() - start
        # async scheduling wraps the real output; the scheduler receives the inner one
        setattr(getattr(output, "_model_runner_output", output), FRAME_ATTR, frame)

    def start_timer(self) -> Any:
        if self._cuda:
            import torch

            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin
        return _perf_ns()

    def stop_timer(self, begin: Any, is_draft: bool) -> None:
        frame = self.frame
        if frame is None:
            return
        if self._cuda:
            # CUDA work is asynchronous: host time would measure kernel launches only
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if frame.events is None:
                frame.events = []
            frame.events.append((begin, end, is_draft))
        elif is_draft:
            frame.draft_ns += _perf_ns() - begin
        else:
            frame.verify_ns += _perf_ns() - begin

    def gate(self, req_ids: list[str], requests: dict[str, Any]) -> dict[str, int]:
        """Draft limit per request of this batch where the flags say less than the default."""
        flags = self.collector.flags
        frame = self.frame
        if flags is None or frame is None:
            return {}
        start = _perf_ns()
        bundle_id = self._bundle()
        label_of = self._labels
        labels = list(map(label_of.get, req_ids))  # one C-level pass; new requests are None
        if None in labels:
            for index, request_id in enumerate(req_ids):
                if labels[index] is None:
                    params = getattr(requests.get(request_id), "sampling_params", None)
                    labels[index] = label_of[request_id] = request_labels(
                        request_id, getattr(params, "extra_args", None), self.collector.labeler)
        # the flags are asked once per label pair of the batch, in the batch's order
        limits = {pair: self._limit(flags, bundle_id, pair) for pair in dict.fromkeys(labels)}
        stale = self._stale
        gated: dict[str, int] = {}
        if stale or any(limit is not None for limit in limits.values()):
            for request_id, pair in zip(req_ids, labels):
                limit = 0 if request_id in stale else limits[pair]
                if limit is not None:
                    gated[request_id] = limit
        frame.gated = gated
        self.pending_gate = gated or None
        frame.cost_ns += _perf_ns() - start
        return gated

    def drafter_skipped(self, req_ids: list[str]) -> None:
        """The drafter does not run this step (every request is off)."""
        if not self.stateless_drafter:
            self._stale.update(req_ids)

    def _limit(self, flags: Any, bundle_id: str, labels: tuple[str, str]) -> int | None:
        try:
            state = flags.lookup(bundle_id, labels[0], labels[1])
        except Exception as error:
            self.collector.flag_failed(error)
            return None
        if not state.enabled:
            return 0
        if state.draft_limit is None:
            return None
        return max(0, int(state.draft_limit))

    def _bundle(self) -> str:
        if self._bundle_id is None:
            self._bundle_id = self.collector.bundle_for(self._vllm_config)[0]
        return self._bundle_id


def cut_drafts(req_ids: list[str], drafts: list[list[int]], gated: dict[str, int]) -> list[list[int]]:
    """Proposals with each gated request's list cut to its limit (0: no drafts at all).

    >>> cut_drafts(["a", "b", "c"], [[1, 2, 3], [4, 5, 6], [7]], {"a": 0, "b": 2})
    [[], [4, 5], [7]]
    """
    return [row if (limit := gated.get(request_id)) is None else row[:limit]
            for request_id, row in zip(req_ids, drafts)]


@dataclass
class _RequestState:
    bucket: str
    cohort: str
    arrival: float
    first_token_ts: float | None = None
    speculative: bool = True


class SchedulerTap:
    """Per-scheduler state: request labels and times, this step's rounds, the step counter."""

    def __init__(self, collector: VllmCollector, vllm_config: Any) -> None:
        self.collector = collector
        self.bundle_id, card = collector.bundle_for(vllm_config)
        self._requests: dict[str, _RequestState] = {}
        # (bucket, cohort) of every tracked request, read as a column at the end of each step
        self._labels: dict[str, tuple[str, str]] = {}
        # tracked requests that have not produced a token yet: most steps have none
        self._awaiting_first: set[str] = set()
        self._rounds: dict[str, tuple[int, int]] = {}
        self._finished: list[RequestPayload] = []
        self._frame: StepFrame | None = None
        self._in_step = False
        self._cost_ns = 0
        self._seq = 0
        _warn_about_untapped_paths(vllm_config, collector)
        collector.submit(("bundle", time.time(), self.bundle_id, card))

    def on_add(self, request: Any) -> None:
        params = request.sampling_params
        bucket, cohort = request_labels(request.request_id, getattr(params, "extra_args", None),
                                        self.collector.labeler)
        self._requests[request.request_id] = _RequestState(bucket, cohort, request.arrival_time)
        self._labels[request.request_id] = (bucket, cohort)
        self._awaiting_first.add(request.request_id)

    def begin_step(self, scheduler_output: Any, model_runner_output: Any) -> None:
        self._in_step = self.collector.enabled
        if not self._in_step:
            return
        self._rounds = {}
        self._cost_ns = 0
        frame = self._frame = getattr(model_runner_output, FRAME_ATTR, None)
        if frame is not None and frame.gated:
            start = _perf_ns()
            for request_id, limit in frame.gated.items():
                state = self._requests.get(request_id)
                if state is not None and limit == 0:
                    state.speculative = False
            self._cost_ns = _perf_ns() - start

    def on_round(self, request_id: str, drafted: int, accepted: int) -> None:
        if self._in_step:
            self._rounds[request_id] = (drafted, accepted)

    def on_finished(self, request: Any) -> None:
        state = self._requests.pop(request.request_id, None)
        self._labels.pop(request.request_id, None)
        self._awaiting_first.discard(request.request_id)
        if state is None or not self.collector.enabled:
            return
        start = _perf_ns()
        now = time.time()
        reason = request.get_finished_reason()
        reason = str(reason) if reason is not None else "abort"
        params = request.sampling_params
        sampling = ((params.temperature, params.top_p, params.seed, params.max_tokens)
                    if params is not None else (None, None, None, None))
        payload = RequestPayload("request", now, self.bundle_id, request.request_id, state.bucket, state.cohort,
                                 state.speculative, state.arrival, state.first_token_ts, now,
                                 request.num_output_tokens, reason,
                                 "engine_error" if reason == "error" else None,
                                 request.prompt_token_ids, list(request.output_token_ids), sampling)
        if self._in_step:
            # sent after this step's record, so a consumer sees the request's last round first
            self._finished.append(payload)
        else:  # aborted between steps
            self.collector.submit(payload)
        self._cost_ns += _perf_ns() - start

    def end_step(self, scheduler: Any, scheduler_output: Any, outputs: dict) -> None:
        if not self._in_step:
            return
        self._in_step = False
        start = _perf_ns()
        now = time.time()
        awaiting = self._awaiting_first
        if awaiting:
            for engine_outputs in outputs.values():
                for output in engine_outputs.outputs:
                    if output.new_token_ids and output.request_id in awaiting:
                        awaiting.discard(output.request_id)
                        self._requests[output.request_id].first_token_ts = now
        # The batch as columns: request ids, their labels, and this step's rounds by id; the
        # emitter thread builds the record from them.
        ids = list(scheduler_output.num_scheduled_tokens)
        labels = list(map(self._labels.get, ids))
        if None in labels:
            # requests that finished in this step are no longer tracked, but were in its batch;
            # requests never seen (added before the collector) are left out
            finished = {p.request_id: (p.bucket, p.cohort) for p in self._finished}
            kept = [(i, pair if pair is not None else finished.get(i)) for i, pair in zip(ids, labels)]
            ids = [i for i, pair in kept if pair is not None]
            labels = [pair for _, pair in kept if pair is not None]
        frame = self._frame
        draft_ns = frame.draft_ns if frame is not None else 0
        verify_ns = frame.verify_ns if frame is not None else 0
        if ids:
            kv_usage = scheduler.kv_cache_manager.usage
            rounds = self._rounds
            for part_ids, part_labels in split_step(ids, labels):
                self.collector.submit(StepPayload("step", now, self._seq, self.bundle_id, draft_ns / 1e9,
                                                  verify_ns / 1e9, kv_usage, part_ids, part_labels, rounds))
                self._seq += 1
                draft_ns = verify_ns = 0  # a split step's times are on its first part
        for payload in self._finished:
            self.collector.submit(payload)
        if self._finished:
            self._finished = []
        self._frame = None
        cost = self._cost_ns + (_perf_ns() - start) + (frame.cost_ns if frame is not None else 0)
        self.collector.account_step(cost, timed=frame is not None)


def _warn_about_untapped_paths(vllm_config: Any, collector: VllmCollector) -> None:
    # Two engine configurations the runner-side hooks cannot serve, said once at start-up
    # rather than discovered as missing timings later.
    try:
        v2_runner = bool(vllm_config.use_v2_model_runner)
    except Exception:  # the property validates other settings and may raise on its own
        v2_runner = False
    if v2_runner:
        _LOG.warning("specwatch taps vLLM's V1 model runner and this engine uses Model Runner V2: "
                     "steps carry drafted/accepted/KV but no draft/verify times, and fallback "
                     "flags are not applied; set VLLM_USE_V2_MODEL_RUNNER=0 for both")
    if collector.flags is not None and getattr(vllm_config.scheduler_config, "async_scheduling", False):
        _LOG.warning("specwatch fallback flags cut drafts per request only with synchronous "
                     "scheduling (async_scheduling=False, the default on CPU); with async "
                     "scheduling the scheduler reserves draft slots before drafts exist")
