"""The vLLM collector's hook path by itself: recorded step shapes replayed through its wrappers on
stand-in engine objects that do nothing, so their thread CPU time is the collector's."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from specwatch.collectors.vllm.collector import VllmCollector
from specwatch.collectors.vllm.hooks import wrap_classes
from specwatch.schemas import StepRecord

__all__ = ["StepShape", "HookPathCost", "RecordList", "step_shapes", "replay_hook_path"]

_DEFAULT_REPEAT = 20
_PROMPT_IDS = list(range(100, 124))
_DRAFT = [1, 2, 3, 4]


@dataclass(frozen=True)
class StepShape:
    """One engine step as the hooks see it: the batch, its rounds, who joined and who finished."""

    scheduled: tuple[str, ...]
    rounds: tuple[tuple[str, int, int], ...]  # (request id, drafted, accepted) for requests that drafted
    added: tuple[str, ...]
    finished: tuple[str, ...]
    labels: dict[str, tuple[str, str]] = field(default_factory=dict, compare=False)


class RecordList(list):
    """A collector's sink that keeps every record it is given."""

    def emit(self, record: Any) -> None:
        self.append(record)


@dataclass(frozen=True)
class HookPathCost:
    """Thread CPU per step of a replay: with the hooks, with the collector off, and the stand-ins alone."""

    steps: int
    hooked_us: float
    off_us: float
    bare_us: float
    self_timed_us: float  # what the collector's own account says (`CollectorStats.cost_s` per step)
    records: list = field(repr=False)

    @property
    def collector_us(self) -> float:
        """The collector's engine-thread time per step: hooked less bare."""
        return self.hooked_us - self.bare_us

    @property
    def collector_off_us(self) -> float:
        """What the wrappers cost per step with the collector switched off."""
        return self.off_us - self.bare_us


def step_shapes(steps: Sequence[StepRecord]) -> list[StepShape]:
    """The shapes of recorded step records: a request joins at its first step and finishes at its last.

    >>> from specwatch.schemas import RoundEntry
    >>> def step(seq, *rows):
    ...     return StepRecord(v=1, ts=1.0 + seq, worker="w", seq=seq, bundle_id="b", draft_ms=1.0, verify_ms=2.0,
    ...                       kv_usage=0.1, requests=[RoundEntry(id=i, bucket="coding", cohort="main",
    ...                                                          drafted=d, accepted=a) for i, d, a in rows])
    >>> first, second = step_shapes([step(0, ("a", 0, 0), ("b", 4, 2)), step(1, ("b", 4, 4))])
    >>> first.added, first.finished, first.rounds, second.added, second.finished
    (('a', 'b'), ('a',), (('b', 4, 2),), (), ('b',))
    """
    last_step: dict[str, int] = {}
    for index, step in enumerate(steps):
        for entry in step.requests:
            last_step[entry.id] = index
    seen: set[str] = set()
    shapes = []
    for index, step in enumerate(steps):
        ids = tuple(entry.id for entry in step.requests)
        added = tuple(i for i in ids if i not in seen)
        seen.update(added)
        shapes.append(StepShape(
            scheduled=ids,
            rounds=tuple((e.id, e.drafted, e.accepted) for e in step.requests if e.drafted),
            added=added,
            finished=tuple(i for i in ids if last_step[i] == index),
            labels={e.id: (e.bucket, e.cohort) for e in step.requests}))
    return shapes


def _stand_in_classes() -> tuple[type, type]:
    """Fresh classes each call: wrapping is per class, and each replay binds its own collector."""

    class ModelRunner:
        def __init__(self, vllm_config: Any) -> None:
            self.vllm_config = vllm_config
            self.speculative_config = vllm_config.speculative_config
            self.device = SimpleNamespace(type="cpu")
            self.input_batch = SimpleNamespace(req_ids=[])
            self.requests: dict[str, Any] = {}
            self.next_output: Any = None
            self._drafts: Any = None

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
            self._model_forward()
            return None  # the output comes from sample_tokens, as in a speculative step

        def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
            return None

        def _input_fits_in_drafter(self, *args: Any) -> bool:
            return True

        def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *args: Any) -> Any:
            return [list(_DRAFT) for _ in self.input_batch.req_ids]

        def sample_tokens(self, grammar_output: Any) -> Any:
            if self._input_fits_in_drafter(None):
                self._drafts = self.propose_draft_token_ids(None, None)
            return self.next_output

        def take_draft_token_ids(self) -> Any:
            drafts, self._drafts = self._drafts, None
            if drafts is None:
                return None
            return SimpleNamespace(req_ids=list(self.input_batch.req_ids), draft_token_ids=drafts)

    class Scheduler:
        def __init__(self, vllm_config: Any) -> None:
            self.vllm_config = vllm_config
            self.kv_cache_manager = SimpleNamespace(usage=0.25)
            self.step: Any = None

        def add_request(self, request: Any) -> None:
            return None

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            step = self.step
            for request_id, drafted, accepted in step.shape.rounds:
                self.make_spec_decoding_stats(None, drafted, accepted, None, request_id)
            for request in step.finished:
                self._free_request(request)
            return step.outputs

        def make_spec_decoding_stats(self, spec_decoding_stats: Any, num_draft_tokens: int,
                                     num_accepted_tokens: int, num_invalid_spec_tokens: Any,
                                     request_id: str) -> Any:
            return spec_decoding_stats

        def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
            return None

        def shutdown(self) -> None:
            return None

    return ModelRunner, Scheduler


class _Request:
    """What the scheduler hooks read from a vLLM Request."""

    def __init__(self, request_id: str, labels: tuple[str, str], output_tokens: int) -> None:
        self.request_id = request_id
        self.arrival_time = time.time()
        self.sampling_params = SimpleNamespace(
            temperature=0.0, top_p=1.0, seed=7, max_tokens=output_tokens,
            extra_args={"specwatch_bucket": labels[0], "specwatch_cohort": labels[1]})
        self.prompt_token_ids = _PROMPT_IDS
        self.output_token_ids = list(range(output_tokens))
        self.num_output_tokens = output_tokens

    def get_finished_reason(self) -> str:
        return "length"


def _prepared(shapes: Sequence[StepShape], repeat: int) -> list[SimpleNamespace]:
    """Every object a replay hands the hooks, built before the clock starts."""
    lengths: dict[str, int] = {}
    labels: dict[str, tuple[str, str]] = {}
    for shape in shapes:
        labels.update(shape.labels)
        for request_id in shape.scheduled:
            lengths[request_id] = lengths.get(request_id, 0) + 1
    prepared = []
    for _ in range(repeat):
        finished_before: tuple[str, ...] = ()
        for shape in shapes:
            prepared.append(SimpleNamespace(
                shape=shape,
                added=[_Request(i, labels[i], lengths[i]) for i in shape.added],
                finished=[_Request(i, labels[i], lengths[i]) for i in shape.finished],
                scheduler_output=SimpleNamespace(num_scheduled_tokens={i: 1 for i in shape.scheduled},
                                                 finished_req_ids=set(finished_before)),
                runner_output=SimpleNamespace(),
                outputs={0: SimpleNamespace(outputs=[SimpleNamespace(request_id=i, new_token_ids=[7])
                                                     for i in shape.scheduled])}))
            finished_before = shape.finished
    return prepared


def _run(runner: Any, scheduler: Any, prepared: list[SimpleNamespace]) -> float:
    """Thread CPU seconds of one replay, in the order a V1 engine step calls the hooked methods."""
    requests = runner.requests
    gc.collect()
    start = time.thread_time()
    for step in prepared:
        for request in step.added:
            scheduler.add_request(request)
            requests[request.request_id] = request
        runner.input_batch.req_ids = list(step.shape.scheduled)
        runner.next_output = step.runner_output
        scheduler.step = step
        runner.execute_model(step.scheduler_output)
        output = runner.sample_tokens(None)
        scheduler.update_from_output(step.scheduler_output, output)
        runner.take_draft_token_ids()
        for request in step.finished:
            requests.pop(request.request_id, None)
    return time.thread_time() - start


def replay_hook_path(vllm_config: Any, steps: Sequence[StepRecord], *, flags: Any = None,
                     repeat: int = _DEFAULT_REPEAT) -> HookPathCost:
    """Replay ``steps`` through the hooks ``repeat`` times: collector on, off, and no hooks at all.
    The hooked replay's records come with the cost, to check that the replay is faithful."""
    shapes = step_shapes(steps)
    sink = RecordList()
    collector = VllmCollector(sink, flags=flags, worker="hook-path")
    runner_cls, scheduler_cls = _stand_in_classes()
    wrap_classes(runner_cls, scheduler_cls, lambda role: collector, where="the stand-in engine")
    bare_runner_cls, bare_scheduler_cls = _stand_in_classes()
    hooked = (runner_cls(vllm_config), scheduler_cls(vllm_config))
    bare = (bare_runner_cls(vllm_config), bare_scheduler_cls(vllm_config))
    before = collector.stats()
    hooked_s = _run(*hooked, _prepared(shapes, repeat))
    after = collector.stats()
    collector.flush()
    records = list(sink)
    collector.enabled = False
    off_s = _run(*hooked, _prepared(shapes, repeat))
    bare_s = _run(*bare, _prepared(shapes, repeat))
    collector.close()
    n = len(shapes) * repeat
    steps_counted = max(1, after.steps - before.steps)
    return HookPathCost(steps=n, hooked_us=hooked_s / n * 1e6, off_us=off_s / n * 1e6, bare_us=bare_s / n * 1e6,
                        self_timed_us=(after.cost_s - before.cost_s) / steps_counted * 1e6, records=records)
