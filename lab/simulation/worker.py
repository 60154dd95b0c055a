"""One simulated engine worker: a continuous batch of requests stepped in event time, incidents
applied as they start, and the contract-v1 records the engine would emit."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from specwatch.schemas import (BundleCard, BundleRecord, RequestRecord, RoundEntry, Sample, Sampling, ShadowRecord,
                               StepRecord, TelemetryRecord, bundle_digest)
from specwatch.schemas.sealed import token_digest
from specwatch.lab.simulation.engine_model import (
    ABORT_RATE, BASELINE, BUCKET_INDEX, CANARY_SHADOW_FRACTION, COHORT_INDEX, COHORT_SHARES,
    CUMULATIVE_COHORT_SHARES, DIFFICULTY_LEVELS, DIURNAL_AMPLITUDE, ERROR_RATE, ERROR_TEXTS,
    FAILURE_CHECK_SHARE, KV_ADMISSION_WATERMARK, KV_CAPACITY_TOKENS, KV_SURGE_WATERMARK, LATENCY_TAIL_FRACTION,
    LOAD_WOBBLE, LOAD_WOBBLE_PERIOD_SECONDS, MAIN, PREFILL_BASE_MS, PREFILL_MS_PER_TOKEN, QUEUE_MEAN_MS,
    SCHEDULE_GAP_MS, SHADOW_CHECK, SHADOW_DELAY_SECONDS, SHADOW_FRACTION, TIMEOUT_RATE, TIMEOUT_TEXT,
    TIMING_JITTER, VERIFY_MS_PER_KV_KTOKEN, WORKER_LOAD_SPREAD, BUCKETS, COHORTS, DEFAULT_CARD, accepted_cdf,
    scale_for_acceptance_length, step_timing)
from specwatch.lab.simulation.scenarios import SHIFTED_WEIGHTS, IncidentPlan, changed_card

if TYPE_CHECKING:
    from specwatch.lab.simulation.simulator import Simulator

__all__ = ["SimulatedWorker", "worker_name"]

# Token ids of captured requests are drawn from a vocabulary of this size.
_CAPTURE_VOCAB = 32_000
# Steps drawn at once while a batch is unchanged; with a flag source, fewer, so that a
# decision takes effect within about a tenth of a second of event time.
_BLOCK_STEPS = 24
_CLOSED_LOOP_BLOCK_STEPS = 8
_WARMUP_SECONDS = 20.0  # runs before t=0 unrecorded, so the first records are steady state
_HEARTBEAT_SECONDS = 60.0


def worker_name(index: int) -> str:
    return f"w{index + 1}"


_STEP_FIELDS_SET = frozenset(StepRecord.model_fields) - {"kind"}
_set_attribute = object.__setattr__  # what pydantic itself uses to fill a frozen model


def _trusted_step(values: dict) -> StepRecord:
    """A `StepRecord` from ``values`` (every field, in declaration order) valid by construction:
    ``model_construct`` minus its bookkeeping, as validating costs more than simulating the step."""
    record = StepRecord.__new__(StepRecord)
    _set_attribute(record, "__dict__", values)
    # a set of its own, as pydantic gives every model: model_copy(update=...) adds to it
    _set_attribute(record, "__pydantic_fields_set__", set(_STEP_FIELDS_SET))
    _set_attribute(record, "__pydantic_extra__", None)
    _set_attribute(record, "__pydantic_private__", None)
    return record


class _Request:
    """A request's fixed facts, its progress while off the batch, and the round entries it made."""

    __slots__ = ("id", "bucket", "cohort", "level", "prompt_tokens", "output_tokens", "max_tokens",
                 "arrival", "ttft_ms", "fail_u", "fail_remaining", "tail_u", "shadow_u", "shadow_delay",
                 "error_text_u", "sampling", "prompt_sha256", "output_sha256", "entries", "speculated",
                 "remaining", "kv_tokens", "shadow_fraction")

    def end_reason(self) -> str:
        return "length" if self.output_tokens >= self.max_tokens else "stop"

    def round_entry(self, code: int, width: int) -> RoundEntry:
        # Round entries are immutable and a request repeats few (drafted, accepted) pairs,
        # so each distinct pair is built once and shared by every step that reports it.
        entry = RoundEntry(id=self.id, bucket=BUCKETS[self.bucket].name, cohort=COHORTS[self.cohort],
                           drafted=code // width, accepted=code % width)
        self.entries[code] = entry
        return entry


@dataclass
class _Conditions:
    """What incidents have changed on one worker so far (all healthy at first)."""

    acceptance_factor: list[float]
    draft_factor: float = 1.0
    tail: tuple[int, int, float] | None = None  # bucket, cohort, multiplier
    mismatch: tuple[int, float, int | None] | None = None  # bucket, fraction, cohort (None = any)
    error_factor: dict[tuple[int, int | None], float] = field(default_factory=dict)  # (bucket, cohort or None)
    surge_share: float | None = None
    late_acceptance: dict[int, float] = field(default_factory=dict)  # bucket -> factor on late positions
    prompt_factor: dict[int, float] = field(default_factory=dict)  # bucket -> multiplier on prompt length


# Columns of a worker's slot table: one row per running request, the numbers every step touches.
_ROW, _ROW_BASE, _KEY, _ALLOWED, _REMAINING, _STOP_AT, _KV = range(7)
_SLOT_COLUMNS = 7
# Per-request draws are taken from the generator in batches of this many requests.
_REQUEST_DRAW_BATCH = 64
_REQUEST_UNIFORMS = 11


class SimulatedWorker:
    """One engine worker: a continuous batch of requests stepped in event time, drawn in vectorized
    blocks over a slot table, so that Python code runs per step record, never per token."""

    def __init__(self, index: int, sim: "Simulator", rng: np.random.Generator,
                 schedule: list[tuple[float, IncidentPlan]], emit_later: Callable[[float, int, list], None]) -> None:
        self.index = index
        self.name = worker_name(index)
        self.sim = sim
        self.rng = rng
        self.schedule = schedule
        self.emit_later = emit_later
        self.card = DEFAULT_CARD
        self.bundle_id = bundle_digest(DEFAULT_CARD)
        self.draft_length = DEFAULT_CARD.drafter.draft_length
        self.width = self.draft_length + 1
        self.conditions = _Conditions(acceptance_factor=[1.0] * len(BUCKETS))
        self.thresholds = self._acceptance_table()
        self.step_numbers = np.arange(1, _BLOCK_STEPS + 1, dtype=np.int64)[:, None]
        self.load = 1.0 + WORKER_LOAD_SPREAD * (2.0 * rng.random() - 1.0)
        self.wobble_phase = 2.0 * math.pi * rng.random()
        self.next_request = 0
        self.seq = 0
        self.batch: list[_Request] = []
        self.waiting: list[_Request] = []  # queue head blocked on KV, and preempted requests
        self.slots = np.zeros((0, _SLOT_COLUMNS), dtype=np.int64)
        self.kv_total = 0
        self._draws: list[tuple[list[float], list[float], str]] = []
        self._mix: list[float] | None = None  # cached cumulative mix; reset when an incident changes it
        # Stalled requests: done with their tokens, their record due at the stall's end. Until
        # then every step lists them, making no progress: [(record ts, entry)], as a real
        # engine shows a request that is running but stuck.
        self.stalled: list[tuple[float, RoundEntry]] = []

    # -- acceptance ---------------------------------------------------------------------------
    def _acceptance_table(self) -> np.ndarray:
        """Accepted-run thresholds of every (bucket, difficulty) row, row r shifted into [r, r+1)."""
        rows = []
        for b, profile in enumerate(BUCKETS):
            scale = scale_for_acceptance_length(profile, self.draft_length, self.conditions.acceptance_factor[b])
            late = self.conditions.late_acceptance.get(b, 1.0)
            for level in DIFFICULTY_LEVELS:
                p = min(0.99, profile.position_acceptance * level * scale)
                rows.append(accepted_cdf(p, self.draft_length, profile.acceptance_decay, late))
        table = np.array(rows, dtype=np.float64)
        return (table + np.arange(len(rows), dtype=np.float64)[:, None]).ravel()

    # -- load and mix -------------------------------------------------------------------------
    def _concurrency(self, t: float) -> int:
        load = self.load * (1.0 + LOAD_WOBBLE * math.sin(2 * math.pi * t / LOAD_WOBBLE_PERIOD_SECONDS
                                                            + self.wobble_phase))
        if self.sim._scenario.diurnal:
            # One day compressed into the run, starting at the night-time trough.
            load *= 1.0 - DIURNAL_AMPLITUDE * math.cos(2 * math.pi * t / self.sim.duration)
        return max(1, int(self.sim.concurrency * load + 0.5))

    def _cumulative_weights(self, t: float) -> list[float]:
        """Cumulative traffic mix at ``t``; fixed unless the mix shifts or a surge is on."""
        shifting = self.sim._scenario.mix_shift
        if self._mix is not None and not shifting:
            return self._mix
        weights = [self.sim._scenario.bucket_weights.get(b.name, b.weight) for b in BUCKETS]
        if shifting:
            progress = min(1.0, max(0.0, (t - 60.0) / max(1.0, self.sim.duration - 60.0)))
            weights = [w + progress * (SHIFTED_WEIGHTS[b.name] - w) for w, b in zip(weights, BUCKETS)]
        share = self.conditions.surge_share
        if share is not None:
            lc = BUCKET_INDEX["long_context"]
            rest = sum(w for i, w in enumerate(weights) if i != lc)
            weights = [share if i == lc else w * (1.0 - share) / rest for i, w in enumerate(weights)]
        total = sum(weights)
        self._mix = list(itertools.accumulate(w / total for w in weights[:-1]))
        return self._mix

    # -- requests -----------------------------------------------------------------------------
    def _request_draws(self) -> tuple[list[float], list[float], str]:
        if not self._draws:
            rng = self.rng
            uniforms = rng.random((_REQUEST_DRAW_BATCH, _REQUEST_UNIFORMS)).tolist()
            normals = rng.standard_normal((_REQUEST_DRAW_BATCH, 2)).tolist()
            digests = rng.bytes(64 * _REQUEST_DRAW_BATCH).hex()
            self._draws = [(u, z, digests[128 * i:128 * (i + 1)])
                           for i, (u, z) in enumerate(zip(uniforms, normals))][::-1]
        return self._draws.pop()

    def _new_request(self, t: float) -> _Request:
        u, (z0, z1), digest = self._request_draws()
        req = _Request()
        req.id = f"{self.name}-{self.next_request:07d}"
        self.next_request += 1
        req.bucket = b = bisect.bisect_right(self._cumulative_weights(t), u[0])
        req.cohort, req.shadow_fraction = self._route(u[1], bisect.bisect_right(CUMULATIVE_COHORT_SHARES, u[1]))
        req.level = min(len(DIFFICULTY_LEVELS) - 1, int(u[2] * len(DIFFICULTY_LEVELS)))
        profile = BUCKETS[b]
        prompt = profile.prompt_median * math.exp(profile.prompt_sigma * z0)
        if self.conditions.surge_share is not None and b == BUCKET_INDEX["long_context"]:
            prompt *= 1.5  # the surge brings longer documents, not just more of them
        prompt *= self.conditions.prompt_factor.get(b, 1.0)
        req.prompt_tokens = int(min(120_000, max(16, prompt)))
        output = profile.output_median * math.exp(profile.output_sigma * z1)
        req.max_tokens = profile.max_tokens
        req.output_tokens = int(min(profile.max_tokens, max(1, round(output))))
        # Failures and aborts strike at a random point of the output; whether one does is
        # decided when the request gets there, so rate changes apply from their start time.
        req.fail_u = u[3]
        req.fail_remaining = int((req.output_tokens - 1) * u[4]) if u[3] < FAILURE_CHECK_SHARE else 0
        req.tail_u = u[5]
        req.shadow_u = u[6]
        req.shadow_delay = SHADOW_DELAY_SECONDS[0] + (SHADOW_DELAY_SECONDS[1] - SHADOW_DELAY_SECONDS[0]) * u[7]
        req.error_text_u = u[8]
        queue_ms = -QUEUE_MEAN_MS * math.log(1.0 - u[9])
        req.ttft_ms = PREFILL_BASE_MS + PREFILL_MS_PER_TOKEN * req.prompt_tokens * (0.95 + 0.1 * u[2]) + queue_ms
        req.arrival = t - req.ttft_ms / 1000.0
        req.sampling = Sampling(temperature=profile.temperature, top_p=profile.top_p,
                                seed=int(u[10] * 2**31), max_tokens=profile.max_tokens)
        req.prompt_sha256, req.output_sha256 = digest[:64], digest[64:]
        req.entries = [None] * (self.width * self.width)
        req.speculated = False
        req.remaining = req.output_tokens - 1  # the first token comes out of prefill
        req.kv_tokens = req.prompt_tokens + 1
        return req

    def _route(self, u: float, cohort: int) -> tuple[int, float]:
        """The cohort a router puts a request in, given the bundle's admission stage, and the
        share of such requests whose output is shadow-checked (all mirrored ones, more canary)."""
        flags = self.sim.flags
        stage_of = getattr(flags, "admission", None)
        if stage_of is None or cohort == BASELINE:
            return cohort, SHADOW_FRACTION
        state = stage_of(self.bundle_id)
        if state is None or state.stage not in ("shadow", "canary") or state.cohort not in COHORT_INDEX:
            return cohort, SHADOW_FRACTION
        if u >= state.cohort_share * (1.0 - COHORT_SHARES[BASELINE]):
            return MAIN, SHADOW_FRACTION
        return COHORT_INDEX[state.cohort], 1.0 if state.stage == "shadow" else CANARY_SHADOW_FRACTION

    def _admit(self, t: float, emitting: bool) -> None:
        target = self._concurrency(t)
        if len(self.batch) >= target:
            return
        watermark = KV_SURGE_WATERMARK if self.conditions.surge_share is not None else KV_ADMISSION_WATERMARK
        limit = int(watermark * KV_CAPACITY_TOKENS)
        admitted: list[_Request] = []
        kv_total = self.kv_total
        while len(self.batch) + len(admitted) < target:
            req = self.waiting[0] if self.waiting else self._new_request(t)
            if kv_total + req.kv_tokens > limit and (self.batch or admitted):
                if not self.waiting:
                    self.waiting.append(req)  # the head of the queue waits for KV blocks
                break
            if self.waiting:
                self.waiting.pop(0)
            if req.remaining <= 0:  # one-token answer: done at prefill, never joins the batch
                if emitting:
                    for record in self._finish(req, t, req.end_reason()):
                        self.emit_later(record.ts, self.index, [record])
                continue
            admitted.append(req)
            kv_total += req.kv_tokens
        if admitted:
            self._append(admitted)

    def _append(self, admitted: list[_Request]) -> None:
        levels, cohorts, d = len(DIFFICULTY_LEVELS), len(COHORTS), self.draft_length
        rows = []
        for r in admitted:
            row = r.bucket * levels + r.level
            allowed = 0 if r.cohort == BASELINE else d
            rows.append((row, row * d, r.bucket * cohorts + r.cohort, allowed, r.remaining,
                         r.fail_remaining, r.kv_tokens))
            if self.sim.flags is None:
                r.speculated = allowed > 0
            self.kv_total += r.kv_tokens
        self.batch.extend(admitted)
        self.slots = np.concatenate([self.slots, np.array(rows, dtype=np.int64)])

    def _remove(self, slots: Sequence[int], kv_tokens: int) -> None:
        """Drop the given slots, which held ``kv_tokens`` of KV cache between them."""
        gone = set(slots)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        self.batch = [self.batch[i] for i in keep]
        self.slots = self.slots[keep]
        self.kv_total -= kv_tokens

    # -- incidents ----------------------------------------------------------------------------
    def _begin(self, plan: IncidentPlan, intensity: float) -> BundleCard | None:
        """Apply one incident to this worker; returns the new card when the card changed."""
        c = self.conditions
        bucket = BUCKET_INDEX[plan.bucket] if plan.bucket else None
        cohort = COHORTS.index(plan.cohort) if plan.cohort else None
        if plan.kind == "acceptance_drop":
            c.acceptance_factor[bucket] = 1.0 - intensity
            self.thresholds = self._acceptance_table()
        elif plan.kind == "target_update":
            c.acceptance_factor = [1.0 - intensity] * len(BUCKETS)
            self.thresholds = self._acceptance_table()
            return changed_card(self.card, plan.kind)
        elif plan.kind == "bundle_change":
            return changed_card(self.card, plan.kind)
        elif plan.kind in ("draft_regression", "draft_cost_doubles"):
            c.draft_factor = intensity
        elif plan.kind == "late_acceptance_decay":
            c.late_acceptance[bucket] = intensity
            self.thresholds = self._acceptance_table()
        elif plan.kind == "context_shift":
            c.prompt_factor[bucket] = intensity
        elif plan.kind in ("latency_tail", "canary_tail"):
            c.tail = (bucket, cohort, intensity)
        elif plan.kind == "kv_pressure":
            c.surge_share = intensity
            self._mix = None
        elif plan.kind in ("quality_mismatch", "canary_mismatch"):
            c.mismatch = (bucket, intensity, cohort)
        elif plan.kind == "error_burst":
            c.error_factor[(bucket, cohort)] = intensity
        return None

    # -- one block of steps -------------------------------------------------------------------
    def _draft_positions(self) -> np.ndarray:
        """Draft positions per running request, after asking the flag source (closed loop)."""
        allowed = self.slots[:, _ALLOWED]
        flags = self.sim.flags
        if flags is None:
            return allowed
        cohorts = len(COHORTS)
        table = np.zeros(len(BUCKETS) * cohorts, dtype=np.int64)
        for b, profile in enumerate(BUCKETS):
            for c, cohort in enumerate(COHORTS):
                if c == BASELINE:
                    continue
                state = flags.lookup(self.bundle_id, profile.name, cohort)
                if state.enabled:
                    limit = state.draft_limit
                    table[b * cohorts + c] = self.draft_length if limit is None else max(
                        0, min(self.draft_length, int(limit)))
        drafted = np.minimum(table[self.slots[:, _KEY]], allowed)
        for req, positions in zip(self.batch, drafted.tolist()):
            if positions:
                req.speculated = True
        return drafted

    def _block(self, t: float, horizon: float,
               emitting: bool) -> tuple[float, list[tuple[float, list[TelemetryRecord]]]]:
        """Run engine steps from ``t`` while the batch stays the same: the end time and, when
        emitting, ``(ts, records)`` per step. Draws past the block's end are discarded.

        A block ends after a step where a request finishes or fails, or KV overflows, after
        ``_BLOCK_STEPS``, or before a step that would start at or after ``horizon``.
        """
        n = len(self.batch)
        slots = self.slots
        block = _BLOCK_STEPS if self.sim.flags is None else _CLOSED_LOOP_BLOCK_STEPS
        drafted = self._draft_positions()
        u = self.rng.random((block, n + 3))
        # Row r's thresholds live in [r, r+1) of one sorted array, so a single searchsorted
        # counts, for every request at once, the thresholds its uniform draw passes.
        accepted = np.searchsorted(self.thresholds, u[:, :n] + slots[:, _ROW], side="right") - slots[:, _ROW_BASE]
        np.minimum(accepted, drafted, out=accepted)
        produced = accepted.cumsum(axis=0) + self.step_numbers[:block]  # every round adds the target's token
        attention = produced >= slots[:, _REMAINING] - slots[:, _STOP_AT]
        first = int(attention.argmax())  # row-major: the earliest step any request needs attention
        attention_step = first // n if attention.flat[first] else block
        steps = min(block, attention_step + 1)
        kv_total = self.kv_total
        kv_after = [kv_total + x for x in produced[:steps].sum(axis=1).tolist()]
        per_request = drafted.tolist()
        drafted_tokens = sum(per_request)
        drafting = n - per_request.count(0)
        draft_ms, verify_fixed = step_timing(n, drafting, max(per_request), drafted_tokens, 0,
                                             self.conditions.draft_factor)
        jitter = u[:steps, n:].tolist()
        out: list[tuple[float, list[TelemetryRecord]]] = []
        if emitting:
            width, seq = self.width, self.seq
            start_ts, name, bundle_id, batch = self.sim.start_ts, self.name, self.bundle_id, self.batch
            codes = (drafted * width + accepted[:steps]).tolist()
            caches = [req.entries for req in batch]
        end = t
        ran = 0
        for k in range(steps):
            if k and (end >= horizon or kv_after[k - 1] > KV_CAPACITY_TOKENS):
                break
            j_draft, j_verify, j_gap = jitter[k]
            draft = draft_ms * (1.0 + TIMING_JITTER * (j_draft - 0.5))
            verify = (verify_fixed + VERIFY_MS_PER_KV_KTOKEN / 1000.0 * kv_after[k]) * (
                1.0 + TIMING_JITTER * (j_verify - 0.5))
            end += (draft + verify + SCHEDULE_GAP_MS * (1.0 + j_gap)) / 1000.0
            ran += 1
            if emitting:
                seq += 1
                ts = round(start_ts + end, 6)
                entries = [cache[code] or req.round_entry(code, width)
                           for req, cache, code in zip(batch, caches, codes[k])]
                if self.stalled:
                    entries += [entry for until, entry in self.stalled if ts < until]
                usage = kv_after[k] / KV_CAPACITY_TOKENS
                out.append((ts, [_trusted_step({
                    "v": 1, "ts": ts, "kind": "step", "worker": name, "seq": seq, "bundle_id": bundle_id,
                    "draft_ms": round(draft, 3), "verify_ms": round(verify, 3),
                    "kv_usage": round(usage if usage < 1.0 else 1.0, 4), "requests": entries})]))
        steps = ran
        if self.stalled and emitting:
            done_by = round(self.sim.start_ts + end, 6)
            self.stalled = [stall for stall in self.stalled if stall[0] > done_by]
        last = produced[steps - 1]
        slots[:, _REMAINING] -= last
        slots[:, _KV] += last
        self.kv_total = kv_after[steps - 1]
        self.seq += steps
        if steps == attention_step + 1:
            # the attention row compared what the block produced with what each request had
            # left, i.e. it marks exactly the slots now at their end or failure point
            due = np.flatnonzero(attention[attention_step]).tolist()
            self._settle(due, end, out[-1][1] if emitting else None)
        if self.kv_total > KV_CAPACITY_TOKENS:
            self._preempt()
        return end, out

    def _settle(self, due: list[int], t_end: float, records: list | None) -> None:
        """Finish, fail or pass the requests that reached their end or their failure point."""
        done: list[int] = []
        freed = 0
        remaining = self.slots[:, _REMAINING].tolist()
        kv = self.slots[:, _KV].tolist()
        for slot in due:
            req = self.batch[slot]
            if remaining[slot] <= 0:
                freed += kv[slot]
                done.append(slot)
                if records is not None:
                    records.extend(self._finish(req, t_end, req.end_reason()))
                continue
            outcome = self._failure(req)
            if outcome is None:
                self.slots[slot, _STOP_AT] = 0  # past its failure point: runs to the end
                continue
            done.append(slot)
            freed += kv[slot]
            if records is not None:
                req.output_tokens -= remaining[slot]
                records.extend(self._finish(req, t_end, outcome))
        if done:
            self._remove(done, freed)

    def _failure(self, req: _Request) -> str | None:
        factor = 1.0
        if req.speculated:
            factor = self.conditions.error_factor.get((req.bucket, req.cohort),
                                                      self.conditions.error_factor.get((req.bucket, None), 1.0))
        error, timeout = ERROR_RATE * factor, TIMEOUT_RATE * factor
        u = req.fail_u
        if u < error:
            return "error"
        if u < error + timeout:
            return "timeout"
        if u < error + timeout + ABORT_RATE:
            return "abort"
        return None

    def _finish(self, req: _Request, t: float, reason: str) -> list[TelemetryRecord]:
        """The request record (and maybe a later shadow record) of a request that ended at ``t``."""
        end_ts = round(self.sim.start_ts + t, 6)
        e2e_ms = (t - req.arrival) * 1000.0
        tail = self.conditions.tail
        delayed = False
        if (tail is not None and req.speculated and req.bucket == tail[0] and req.cohort == tail[1]
                and req.tail_u < LATENCY_TAIL_FRACTION):
            # A stalled request finishes late: its record leaves when the stall ends.
            e2e_ms = req.ttft_ms + (e2e_ms - req.ttft_ms) * tail[2]
            end_ts = max(end_ts, round(self.sim.start_ts + req.arrival + e2e_ms / 1000.0, 6))
            delayed = True
        tokens = req.output_tokens
        tpot_ms = (e2e_ms - req.ttft_ms) / (tokens - 1) if tokens > 1 else None
        error = None
        if reason == "error":
            error = ERROR_TEXTS[min(len(ERROR_TEXTS) - 1, int(req.error_text_u * len(ERROR_TEXTS)))]
        elif reason == "timeout":
            error = TIMEOUT_TEXT
        record = RequestRecord(
            v=1, ts=end_ts, worker=self.name, bundle_id=self.bundle_id, id=req.id,
            bucket=BUCKETS[req.bucket].name, cohort=COHORTS[req.cohort], speculative=req.speculated,
            ttft_ms=round(req.ttft_ms, 3), tpot_ms=None if tpot_ms is None else round(tpot_ms, 3),
            e2e_ms=round(e2e_ms, 3), output_tokens=tokens, finish_reason=reason, error=error,
            sample=self._sample(req, tokens),
        )
        out: list[TelemetryRecord] = []
        if delayed:
            self.emit_later(end_ts, self.index, [record])
            self.stalled.append((end_ts, RoundEntry(id=req.id, bucket=record.bucket, cohort=record.cohort,
                                                    drafted=0, accepted=0)))
        else:
            out.append(record)
        fraction = req.shadow_fraction
        if req.speculated and reason in ("stop", "length") and req.shadow_u < fraction:
            match = True
            mismatch = self.conditions.mismatch
            if mismatch is not None and req.bucket == mismatch[0] and mismatch[2] in (None, req.cohort):
                # shadow_u is uniform below the shadow fraction: rescale it for a second draw
                match = req.shadow_u / fraction >= mismatch[1]
            shadow_ts = round(end_ts + req.shadow_delay, 6)
            self.emit_later(shadow_ts, self.index, [ShadowRecord(
                v=1, ts=shadow_ts, bundle_id=self.bundle_id, id=req.id, bucket=BUCKETS[req.bucket].name,
                check=SHADOW_CHECK, match=match)])
        return out

    def _sample(self, req: _Request, output_tokens: int) -> Sample:
        capture = self.sim.capture
        bucket = BUCKETS[req.bucket].name
        if capture is None or not capture.wants(req.id, bucket, req.prompt_tokens, output_tokens):
            return Sample(prompt_sha256=req.prompt_sha256, output_sha256=req.output_sha256, sampling=req.sampling)
        # A captured request gets token ids of its own (seeded by its id) and digests over them.
        rng = np.random.default_rng([self.sim.seed, *req.id.encode()])
        prompt_ids = rng.integers(0, _CAPTURE_VOCAB, req.prompt_tokens).tolist()
        output_ids = rng.integers(0, _CAPTURE_VOCAB, output_tokens).tolist()
        return Sample(prompt_sha256=token_digest(prompt_ids), output_sha256=token_digest(output_ids),
                      sampling=req.sampling, sealed=capture.seal(req.id, bucket, prompt_ids, output_ids))

    def _preempt(self) -> None:
        """Out of KV blocks: the newest requests go back to the queue (recompute), as vLLM does."""
        preempted = []
        kv = self.slots[:, _KV].tolist()
        total = self.kv_total
        for slot in range(len(self.batch) - 1, 0, -1):
            if total <= KV_CAPACITY_TOKENS:
                break
            req = self.batch[slot]
            req.remaining = int(self.slots[slot, _REMAINING])
            req.fail_remaining = int(self.slots[slot, _STOP_AT])
            req.kv_tokens = kv[slot]
            preempted.append(slot)
            total -= kv[slot]
        self.waiting[:0] = [self.batch[s] for s in reversed(preempted)]
        self._remove(preempted, self.kv_total - total)

    # -- the worker's stream of record batches --------------------------------------------------
    def run(self) -> Iterator[tuple[float, list[TelemetryRecord]]]:
        """Batches of records, each sharing one event time (rounded ts), in non-decreasing time."""
        sim = self.sim
        t = -_WARMUP_SECONDS
        while t < 0.0:
            self._admit(t, emitting=False)
            t, _ = self._block(t, 0.0, emitting=False)
        yield round(sim.start_ts, 6), [self._bundle_record(0.0)]
        next_heartbeat = _HEARTBEAT_SECONDS
        schedule = self.schedule
        next_change = schedule[0][0] if schedule else math.inf
        while True:
            if t >= next_change:
                while schedule and schedule[0][0] <= t:
                    _, plan = schedule.pop(0)
                    card = self._begin(plan, sim._intensity(plan))
                    if card is not None:
                        self.card, self.bundle_id = card, bundle_digest(card)
                        record = self._bundle_record(t)
                        yield record.ts, [record]  # a changed card is announced at once
                        next_heartbeat = t + _HEARTBEAT_SECONDS
                next_change = schedule[0][0] if schedule else math.inf
            if t >= next_heartbeat:
                record = self._bundle_record(t)
                yield record.ts, [record]
                next_heartbeat += _HEARTBEAT_SECONDS
            self._admit(t, emitting=True)
            t, steps = self._block(t, min(next_change, next_heartbeat), emitting=True)
            yield from steps

    def _bundle_record(self, t: float) -> BundleRecord:
        return BundleRecord(v=1, ts=round(self.sim.start_ts + t, 6), worker=self.name,
                            bundle_id=self.bundle_id, card=self.card)
