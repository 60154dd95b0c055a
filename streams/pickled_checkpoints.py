"""Pickled stage-task checkpoints of earlier versions, converted once into this version's tasks.

The unpickler resolves only the names those checkpoints hold (`_ALLOWED`); any other is refused.
"""

from __future__ import annotations

import io
import math
import pickle
from collections import Counter, defaultdict, deque

from fastdigest import TDigest
from pydantic import BaseModel
from river._river_rust.drift import AdaptiveWindowing

from specwatch.actions import admission, fallback, flags
from specwatch.actions.decider import SliceDecider
from specwatch.detectors import baseline, canary, gates, monitor, stalls
from specwatch.schemas import codec, policy, slice_stats
from specwatch.schemas.checkpoint import PICKLED_CHECKPOINT_MAGIC, CheckpointError, inflated
from specwatch.schemas.latency_sketch import LatencySketch
from specwatch.schemas.otlp import decode_request
from specwatch.schemas.otlp_block import record_at

from . import combine, intake, merge, running_requests, slice_batch, sources
from .stage_tasks import BundleOwner, Stage1Task, Stage2Task

__all__ = ["load_pickled_task"]

def _flag_store(state: dict) -> flags.FlagStore:
    # The reducer of earlier versions pickled the store's fields but its lock and cache.
    return flags.FlagStore(**{name: state[name] for name in ("_auto", "_manual", "_stages", "_manual_stages")})


def _sketch(max_centroids: int, digest: bytes, pending: list) -> LatencySketch:
    return LatencySketch.from_state({"max_centroids": max_centroids, "pending": pending,
                                     "digest": TDigest.from_bytes(digest).to_dict() if digest else None})


class _HeldStep:
    """Stands for `functools.partial` in these pickles, where it only ever held a step record to be
    decoded later from the bytes it came in; any other function is refused."""

    _DECODERS = (record_at,)

    def __init__(self, func, *args, **kwargs) -> None:
        self._hold(func, args, kwargs)

    def __setstate__(self, state: tuple) -> None:
        func, args, kwargs, _ = state
        self._hold(func, tuple(args), dict(kwargs or {}))

    def _hold(self, func, args: tuple, kwargs: dict) -> None:
        if not any(func is decoder for decoder in self._DECODERS):
            raise pickle.UnpicklingError(f"a held step of {getattr(func, '__name__', func)!r} is not a record decoder")
        self.func, self.args, self.kwargs = func, args, kwargs

    def __call__(self, *more):
        return self.func(*self.args, *more, **self.kwargs)


class _PickledEventClock(intake.EventClock):
    """An event clock as the last pickling version wrote it: one writer, no offsets."""

    __slots__ = ()

    def __setstate__(self, state) -> None:
        slots = state[1] if isinstance(state, tuple) else state
        self.__init__(slots["max_skew"], slots["_size"])
        state = {"now": slots["now"], "median": slots["_median"], "recent": slots["_recent"], "seen": slots["_seen"]}
        # without "primed" it had seen records: they were its one writer's, in line (primed, started at its median)
        if "primed" in slots:
            state |= {"primed": slots["primed"], "start": slots.get("_start", math.nan)}
        self.load_state(state)


class _PickledRunningWorker(running_requests.WorkerRequests):
    """One worker's running requests as the last pickling version wrote them: no requests lost in a jump."""

    __slots__ = ()

    def __setstate__(self, state) -> None:
        slots = state[1] if isinstance(state, tuple) else state
        for name, value in slots.items():
            setattr(self, name, value)
        if "gone" not in slots:
            self.gone = {}


class _PickledScopeMemory(fallback.ScopeMemory):
    """A scope's fallback memory as the last pickling version wrote it: fields added since take their defaults."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(vars(fallback.ScopeMemory()))
        self.__dict__.update(state)


class _PickledStage2(merge.Stage2):
    """Stage 2 as the last pickling version wrote it: what its decider holds now was its own."""

    _DECIDER_PARTS = ("policy", "owns", "flags", "fallback", "admission", "monitors", "pools", "cards",
                      "worker_cards", "shadow_counts", "last_mismatch")

    def __setstate__(self, state: dict) -> None:
        decider = SliceDecider.__new__(SliceDecider)
        decider.__dict__.update({name: state[name] for name in self._DECIDER_PARTS if name in state})
        self.__dict__.update({name: value for name, value in state.items() if name not in self._DECIDER_PARTS})
        self.policy, self.decider = state["policy"], decider


def _names(module, *names: str, pickled_as: str | None = None) -> dict[tuple[str, str], object]:
    """``names`` of ``module``, under the module name the pickles hold (``pickled_as``: its old name)."""
    return {(pickled_as or module.__name__, name): getattr(module, name) for name in names}


_OLD_TASKS = "specwatch.streams.faust_tasks"
_OLD_TOPOLOGY = "specwatch.streams.topology"  # stage 1, stage 2 and their slices, one module then
# Every name a checkpoint pickled by the last pickling version holds, and what it loads as here.
_ALLOWED: dict[tuple[str, str], object] = {
    ("builtins", "dict"): dict,
    ("collections", "Counter"): Counter,
    ("collections", "defaultdict"): defaultdict,
    ("collections", "deque"): deque,
    ("functools", "partial"): _HeldStep,
    ("river._river_rust.drift", "AdaptiveWindowing"): AdaptiveWindowing,
    (_OLD_TASKS, "Stage1Task"): Stage1Task,
    (_OLD_TASKS, "Stage2Task"): Stage2Task,
    (_OLD_TASKS, "BundleOwner"): BundleOwner,
    (_OLD_TASKS, "_restore_flag_store"): _flag_store,
    (_OLD_TASKS, "_restore_sketch"): _sketch,
    ("specwatch.schemas.fastdecode", "_record_at"): record_at,  # its name before it was public
    ("specwatch.schemas.otlp", "decode_request"): decode_request,
    **_names(admission, "AdmissionController", "BundleAdmission", "StageChange"),
    **_names(flags, "AdmissionState", "ScopeState"),
    **_names(fallback, "FallbackPolicy", pickled_as="specwatch.actions.policy"),
    ("specwatch.actions.policy", "ScopeMemory"): _PickledScopeMemory,
    **_names(baseline, "Baseline", "BaselineLearner", "BaselinePool"),
    **_names(canary, "CanaryJudge", "Judgement", "MetricVerdict", "WindowSample"),
    ("specwatch.detectors.canary", "_Side"): canary.ComparedSide,
    **_names(gates, "BernoulliCusum", "ConsecutiveGate", "DropDetector"),
    **_names(monitor, "BundleMonitor", "KeyMonitor"),
    ("specwatch.detectors.monitor", "_draft_costs"): monitor.draft_costs,
    ("specwatch.detectors.monitor", "_speedup_losses"): monitor.speedup_losses,
    **_names(stalls, "StalledRequests"),
    **_names(slice_stats, "SliceStats", pickled_as="specwatch.detectors.window"),
    **_names(codec, "RejectionCounter"),
    **_names(policy, "AcceptancePolicy", "ActionPolicy", "AdmissionPolicy", "BaselinePolicy", "CapturePolicy",
             "DraftOverheadPolicy", "ErrorPolicy", "KvPolicy", "LatencyPolicy", "Policy", "QualityPolicy",
             "SpeedupPolicy", "WindowPolicy"),
    **_names(sources, "Ingest", pickled_as="specwatch.streams.ingest"),
    **_names(intake, "DuplicateFilter"),
    ("specwatch.streams.intake", "EventClock"): _PickledEventClock,
    **_names(running_requests, "RunningRequests", pickled_as="specwatch.streams.running"),
    ("specwatch.streams.running", "_Worker"): _PickledRunningWorker,
    **_names(slice_batch, "SliceBatch", pickled_as=_OLD_TOPOLOGY),
    (_OLD_TOPOLOGY, "_step_record"): slice_batch.step_as_json,
    **_names(combine, "Stage1", pickled_as=_OLD_TOPOLOGY),
    (_OLD_TOPOLOGY, "Stage2"): _PickledStage2,
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a stage-state class of specwatch")
        return found


def _plain(model: BaseModel) -> dict:
    return {name: _plain(value) if isinstance(value, BaseModel) else value for name, value in model.__dict__.items()}


def _revalidated(model: BaseModel) -> BaseModel:
    """A policy as it was pickled, validated again: an unpickled model gets its fields' values as
    they were, so a setting added since (``windows.close_on_writers``) would be missing, not default."""
    return type(model).model_validate(_plain(model))


def load_pickled_task(data: bytes) -> Stage1Task | Stage2Task:
    """The task a pickled checkpoint of an earlier version holds, rebuilt from its plain state.

    Nothing but `_ALLOWED` resolves: a pickle naming any other callable (``os.system``) is refused
    before anything in it runs, with `CheckpointError` (reason ``undecodable``).
    """
    if not bytes(data[:len(PICKLED_CHECKPOINT_MAGIC)]) == PICKLED_CHECKPOINT_MAGIC:
        raise CheckpointError("not_a_checkpoint", "not a pickled specwatch checkpoint")
    try:
        task = _StateUnpickler(io.BytesIO(inflated(data[len(PICKLED_CHECKPOINT_MAGIC):]))).load()
        if not isinstance(task, (Stage1Task, Stage2Task)):
            raise CheckpointError("undecodable", f"the pickle holds a {type(task).__name__}, not a stage task")
        # through the plain state: what does not convert is refused here, not at the next fold
        return type(task).from_state(task.to_state(), _revalidated(task.stage.policy))
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - a panic of a Rust extension (ADWIN, t-digest) too
        raise CheckpointError("undecodable", f"pickled checkpoint refused: {error!r}") from error
