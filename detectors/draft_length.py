"""Which draft length pays best: per-position acceptance, a measured step-cost model, the speedup
curve (docs/DRAFT_LENGTH.md has the model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from specwatch.schemas.slice_stats import SliceStats, merge_all, ratio, round_evidence as _round

__all__ = ["MECHANISM_COST", "CurvePoint", "DraftLengthCurve", "PositionSurvival", "StepCost",
           "curve_from_slices", "draft_length_curve", "starting_draft_length", "tile_draft_lengths"]

# How a drafter's time grows with D: one forward per position ("serial"; an external drafter is
# assumed so) or one per block, whatever D ("parallel").
MECHANISM_COST = {"ngram": "serial", "eagle3": "serial", "mtp": "serial", "external": "serial",
                  "dflash": "parallel", "dspark": "parallel"}

_Z95 = 1.959964  # two-sided 95 %
# Below this many rounds at the first draft position the curve is too thin to pick D from.
_DEFAULT_MIN_ROUNDS = 200
# A slope is fitted only over this many slices whose regressor spreads this much (max-min / mean).
_MIN_RELATIVE_SPREAD = 0.2
_MIN_FIT_SLICES = 5
# Tensor-core tiles of the verify pass hold this many query rows per KV head.
_TILE_ROWS = 128


def _wilson(successes: int, trials: int, z: float = _Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (nan, nan) without trials.

    >>> [round(x, 4) for x in _wilson(80, 100)]
    [0.7112, 0.8666]
    """
    if trials <= 0:
        return math.nan, math.nan
    p = successes / trials
    denominator = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class PositionSurvival:
    """Survival counts per draft position (as in `SliceStats`); under the strict acceptance rule
    P(accepted >= k) measured at D holds at every D' >= k.

    >>> s = PositionSurvival.from_counts([90, 60, 30], [100, 100, 100, 100])
    >>> [round(r, 2) for r in s.rates()], s.max_draft_length
    ([0.9, 0.6, 0.3, 0.0], 4)
    >>> [round(s.acceptance_length(d), 2) for d in range(5)]
    [1.0, 1.9, 2.5, 2.8, 2.8]
    >>> [round(x, 3) for x in s.interval(2)]
    [0.502, 0.691]
    """

    accepted_at_least: tuple[int, ...]
    drafted_at_least: tuple[int, ...]

    @classmethod
    def from_counts(cls, accepted_at_least: Sequence[int], drafted_at_least: Sequence[int]) -> "PositionSurvival":
        drafted = tuple(int(n) for n in drafted_at_least)
        accepted = tuple(int(accepted_at_least[i]) if i < len(accepted_at_least) else 0 for i in range(len(drafted)))
        return cls(accepted, drafted)

    @classmethod
    def from_stats(cls, stats: SliceStats) -> "PositionSurvival":
        return cls.from_counts(stats.accepted_at_least, stats.drafted_at_least)

    @property
    def max_draft_length(self) -> int:
        """The longest D with any evidence: predictions reach this far and no further."""
        return sum(1 for n in self.drafted_at_least if n > 0)

    @property
    def rounds(self) -> int:
        return self.drafted_at_least[0] if self.drafted_at_least else 0

    def rates(self) -> list[float]:
        """P(accepted >= k) for k = 1..max D, NaN where nothing was drafted."""
        return [ratio(a, d) for a, d in zip(self.accepted_at_least, self.drafted_at_least)]

    def interval(self, k: int, z: float = _Z95) -> tuple[float, float]:
        """Wilson interval of P(accepted >= k)."""
        return _wilson(self.accepted_at_least[k - 1], self.drafted_at_least[k - 1], z)

    def acceptance_length(self, draft_length: int) -> float:
        """Predicted tokens per round at D' = ``draft_length``: 1 + sum of P(accepted >= k), k <= D'."""
        rates = self.rates()[:draft_length]
        return 1.0 + sum(rates) if len(rates) == draft_length else math.nan

    def _log_conditional_variances(self) -> list[float]:
        """Var of log P(accepted >= j | accepted >= j-1), per position, from its binomial counts
        (trials estimated for mixed D, half a success and half a failure added)."""
        out, reached = [], None
        for j, (accepted, drafted) in enumerate(zip(self.accepted_at_least, self.drafted_at_least)):
            trials = drafted if j == 0 else (
                reached * drafted / self.drafted_at_least[j - 1] if self.drafted_at_least[j - 1] else 0.0)
            # the estimate assumes the rounds that reached j-1 drafted past it as often as all
            # rounds did; when fewer trials than successes come out, the successes are the floor
            trials = max(trials, accepted)
            if trials <= 0:
                out.append(math.inf)
            else:
                c = (accepted + 0.5) / (trials + 1.0)
                out.append((1.0 - c) / (c * (trials + 1.0)))
            reached = accepted
        return out


@dataclass(frozen=True)
class StepCost:
    """Draft and verify time of one engine step as functions of D, fitted per bundle
    (docs/DRAFT_LENGTH.md: the terms, and when each is fitted).

    >>> slices = []
    >>> for i, d in enumerate([4, 4, 3, 3, 2, 2, 1, 1]):
    ...     b = 12 + i
    ...     s = SliceStats(); s.steps = 10; s.rounds = 10 * b; s.drafted_tokens = 10 * b * d
    ...     s.draft_ms = 10 * (1.5 + d * (0.6 + 0.025 * b)); s.verify_ms = 10 * (7.2 + 0.015 * b * (1 + d))
    ...     slices.append(s)
    >>> cost = StepCost.fit(slices, "eagle3")
    >>> cost.draft_fit, cost.verify_fit, round(cost.draft_per_step, 4), round(cost.draft_slope, 4)
    ('huber', 'huber', 1.5, 0.025)
    >>> round(cost.draft_ms(4), 3), round(cost.verify_ms(2), 3), round(cost.standard_ms, 3)
    (5.45, 7.897, 7.432)
    >>> StepCost.fit(slices[:2], "dflash").draft_fit, StepCost.fit(slices[:2], "dflash").verify_fit
    ('mean', 'flat')
    """

    mechanism: str
    kind: str
    draft_per_step: float
    draft_intercept: float
    draft_slope: float
    verify_intercept: float
    verify_per_request: float
    verify_per_draft_token: float
    requests_per_step: float
    drafting_per_step: float
    slices: int
    steps: int
    draft_fit: str
    verify_fit: str

    @classmethod
    def fit(cls, slices: Iterable[SliceStats], mechanism: str) -> "StepCost":
        kind = MECHANISM_COST.get(mechanism, "serial")
        timed = [s for s in slices if s.steps > 0 and s.rounds > 0]
        total = merge_all(timed, sketches=False)
        steps = total.steps
        requests = ratio(total.rounds + total.plain_entries, steps)
        drafting = ratio(total.rounds, steps)
        passes = [s.drafted_tokens / s.rounds if kind == "serial" else 1.0 for s in timed]
        drafting_x = [s.rounds / s.steps for s in timed]
        pass_ms = [s.draft_ms / s.steps / n for s, n in zip(timed, passes)]
        fitted = _theil_sen(drafting_x, pass_ms)
        # serial draft ms per step = per-step cost + passes * (per pass + per drafting request)
        serial_fit = None if kind != "serial" else _fit_across_d(
            timed, [[1.0, n, n * s.rounds / s.steps] for s, n in zip(timed, passes)],
            [s.draft_ms / s.steps for s in timed])
        if serial_fit is not None:
            draft = (*serial_fit, "huber")
        elif fitted is None:
            all_passes = sum(s.steps * n for s, n in zip(timed, passes))
            draft = (0.0, ratio(total.draft_ms, all_passes), 0.0, "mean")
        else:
            draft = (0.0, *fitted, "theil_sen")
        # verify ms per step = a + b * requests + c * draft tokens (per step)
        verify = _fit_across_d(timed, [[1.0, (s.rounds + s.plain_entries) / s.steps,
                                        s.drafted_tokens / s.steps] for s in timed],
                               [s.verify_ms / s.steps for s in timed])
        verify = (*verify, "huber") if verify else (ratio(total.verify_ms, steps), 0.0, 0.0, "flat")
        return cls(mechanism, kind, *draft[:3], *verify[:3], requests, drafting, len(timed), steps,
                   draft[3], verify[3])

    def draft_ms(self, draft_length: int) -> float:
        per_pass = self.draft_intercept + self.draft_slope * self.drafting_per_step
        return self.draft_per_step + per_pass * (draft_length if self.kind == "serial" else 1)

    def verify_ms(self, draft_length: int) -> float:
        return self.standard_ms + self.verify_per_draft_token * self.drafting_per_step * draft_length

    @property
    def standard_ms(self) -> float:
        """A standard decoding step of the same batch: every request verifies one token."""
        return self.verify_intercept + self.verify_per_request * self.requests_per_step

    def speedup_factor(self, draft_length: int) -> float:
        """Speedup per token of acceptance length at D': t_standard / (t_draft + t_verify)."""
        return ratio(self.standard_ms, self.draft_ms(draft_length) + self.verify_ms(draft_length))

    def to_dict(self) -> dict:
        return {k: _round(v) for k, v in self.__dict__.items()}


def _spread(xs: list[float]) -> float:
    """Relative spread (max - min) / mean; 0 for fewer than the slices a fit needs."""
    if len(xs) < _MIN_FIT_SLICES:
        return 0.0
    mean = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / mean if mean > 0 else 0.0


def _theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Theil-Sen (intercept, slope) when ``xs`` spread enough and the slope is not negative."""
    if _spread(xs) < _MIN_RELATIVE_SPREAD:
        return None
    from scipy.stats import theilslopes

    slope, intercept, _, _ = theilslopes(ys, xs)
    if not slope >= 0 or not math.isfinite(intercept):
        return None
    return float(intercept), float(slope)


def _fit_across_d(timed: list[SliceStats], features: list[list[float]], ms_per_step: list[float]):
    """Coefficients (each >= 0) of ``ms_per_step`` on ``features`` by least squares with a Huber
    loss, only when the slices' mean D varied enough to tell a per-draft-token cost from a
    per-request one; None then or when the fit does not converge."""
    if _spread([s.drafted_tokens / s.rounds for s in timed]) < _MIN_RELATIVE_SPREAD:
        return None
    import numpy as np
    from scipy.optimize import least_squares

    x, y = np.asarray(features, dtype=float), np.asarray(ms_per_step, dtype=float)
    scale = max(float(np.median(np.abs(y - np.median(y)))), 1e-3)
    # from the bound itself the solver would stop at once
    start = np.clip(np.linalg.lstsq(x, y, rcond=None)[0], 1e-6, None)
    fit = least_squares(lambda p: x @ p - y, x0=start, bounds=(0.0, np.inf), loss="huber",
                        f_scale=scale)
    coefficients = tuple(float(v) for v in fit.x)
    return coefficients if fit.success and all(map(math.isfinite, coefficients)) else None


@dataclass(frozen=True)
class CurvePoint:
    """Prediction at one draft length: acceptance length and speedup, each with a 95 % interval."""

    draft_length: int
    acceptance_length: float
    acceptance_low: float
    acceptance_high: float
    speedup: float
    speedup_low: float
    speedup_high: float
    draft_ms: float
    verify_ms: float

    def to_dict(self) -> dict:
        return {k: _round(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class DraftLengthCurve:
    """Predicted speedup for every D' from 1 to the longest D drafted, and what it rests on."""

    survival: PositionSurvival
    cost: StepCost
    points: tuple[CurvePoint, ...]
    min_rounds: int = _DEFAULT_MIN_ROUNDS

    @property
    def thin(self) -> str | None:
        """Why the evidence is too thin to pick D from; None when it is enough."""
        if self.survival.rounds < self.min_rounds:
            return f"{self.survival.rounds} rounds < {self.min_rounds}"
        if self.cost.steps == 0 or math.isnan(self.cost.speedup_factor(1)):
            return "no timed steps for the bundle"
        return None

    def point(self, draft_length: int) -> CurvePoint | None:
        return self.points[draft_length - 1] if 1 <= draft_length <= len(self.points) else None

    def best(self, low: int = 1, high: int | None = None) -> CurvePoint | None:
        """The D' in [low, high] with the highest predicted speedup (the shorter one on a tie)."""
        candidates = [p for p in self.points if p.draft_length >= low and (high is None or p.draft_length <= high)
                      and not math.isnan(p.speedup)]
        return max(candidates, key=lambda p: (p.speedup, -p.draft_length), default=None)

    def gain(self, to: int, relative_to: int, z: float = _Z95) -> tuple[float, float, float]:
        """Speedup gain of D'=``to`` over D'=``relative_to`` (a ratio minus one), with its interval
        from the variance of their difference (they share their position counts)."""
        a, b = self.point(to), self.point(relative_to)
        if a is None or b is None or not b.speedup > 0:
            return math.nan, math.nan, math.nan
        factors = self.cost.speedup_factor(to), self.cost.speedup_factor(relative_to)
        sd = math.sqrt(_variance(self.survival, [(factors[0], to), (-factors[1], relative_to)]))
        return (a.speedup / b.speedup - 1.0, (a.speedup - b.speedup - z * sd) / b.speedup,
                (a.speedup - b.speedup + z * sd) / b.speedup)

    def evidence(self, chosen: int, current: int) -> dict:
        """What a decision naming D'=``chosen`` instead of ``current`` carries: the curve and its basis."""
        gain, low, high = self.gain(chosen, current)
        return {
            "draft_length_basis": "best_predicted_speedup",
            "predicted_speedup_gain": _round(gain),
            "predicted_speedup_gain_interval": [_round(low), _round(high)],
            "draft_length_curve": [
                {"d": p.draft_length, "al": _round(p.acceptance_length, 4),
                 "al_interval": [_round(p.acceptance_low, 4), _round(p.acceptance_high, 4)],
                 "speedup": _round(p.speedup, 4),
                 "speedup_interval": [_round(p.speedup_low, 4), _round(p.speedup_high, 4)]}
                for p in self.points],
            "position_rounds": self.survival.rounds,
            "step_cost": {"mechanism": self.cost.mechanism, "kind": self.cost.kind,
                          "draft_fit": self.cost.draft_fit, "verify_fit": self.cost.verify_fit,
                          "standard_ms": _round(self.cost.standard_ms, 4), "slices": self.cost.slices},
        }

    def to_dict(self) -> dict:
        return {"points": [p.to_dict() for p in self.points], "rounds": self.survival.rounds,
                "position_rates": [_round(r) for r in self.survival.rates()],
                "position_intervals": [[_round(x) for x in self.survival.interval(k)]
                                       for k in range(1, self.survival.max_draft_length + 1)],
                "cost": self.cost.to_dict(), "thin": self.thin}


def _variance(survival: PositionSurvival, terms: list[tuple[float, int]]) -> float:
    """Delta-method variance of sum(factor * AL(D')) over ``terms`` of (factor, D'): the gradient
    of AL(D') in log c_j is the survival mass from position j up to D'."""
    rates, total = survival.rates(), 0.0
    for j, v in enumerate(survival._log_conditional_variances()):
        g = sum(factor * sum(rates[j:d]) for factor, d in terms if j < d)
        if g:
            total += g * g * v
    return total


def draft_length_curve(survival: PositionSurvival, cost: StepCost, min_rounds: int = _DEFAULT_MIN_ROUNDS,
                       z: float = _Z95) -> DraftLengthCurve:
    """Predicted AL and speedup for D' = 1..max D drafted, with delta-method 95 % intervals
    (of the acceptance; the cost model is taken as measured).

    >>> survival = PositionSurvival.from_counts([900, 700, 400, 150], [1000] * 4)
    >>> slices = []
    >>> for _ in range(6):
    ...     s = SliceStats(); s.steps = 10; s.rounds = 160; s.drafted_tokens = 640
    ...     s.draft_ms = 40.0; s.verify_ms = 100.0; slices.append(s)
    >>> curve = draft_length_curve(survival, StepCost.fit(slices, "eagle3"))
    >>> [(p.draft_length, round(p.acceptance_length, 2), round(p.speedup, 3)) for p in curve.points]
    [(1, 1.9, 1.727), (2, 2.6, 2.167), (3, 3.0, 2.308), (4, 3.15, 2.25)]
    >>> curve.best().draft_length, curve.best(high=2).draft_length, curve.thin
    (3, 2, None)
    >>> [round(x, 3) for x in curve.gain(3, 4)]
    [0.026, 0.019, 0.032]
    """
    points = []
    for d in range(1, survival.max_draft_length + 1):
        al = survival.acceptance_length(d)
        half = z * math.sqrt(_variance(survival, [(1.0, d)]))
        factor = cost.speedup_factor(d)
        low, high = max(1.0, al - half), min(1.0 + d, al + half)
        points.append(CurvePoint(d, al, low, high, al * factor, low * factor, high * factor,
                                 cost.draft_ms(d), cost.verify_ms(d)))
    return DraftLengthCurve(survival, cost, tuple(points), min_rounds)


def starting_draft_length(heads_per_kv_head: int) -> int:
    """The usual first guess 128/G - 1: one verify tile full with D+1 tokens per query group.

    >>> starting_draft_length(8), starting_draft_length(4), starting_draft_length(128)
    (15, 31, 0)
    """
    if heads_per_kv_head < 1:
        raise ValueError(f"query heads per KV head must be at least 1, got {heads_per_kv_head}")
    return max(0, _TILE_ROWS // heads_per_kv_head - 1)


def tile_draft_lengths(heads_per_kv_head: int, up_to: int) -> list[int]:
    """Draft lengths D in 1..``up_to`` where G x (1 + D) is a multiple of 128 (whole tiles).

    >>> tile_draft_lengths(8, 40), tile_draft_lengths(64, 8), tile_draft_lengths(6, 100)
    ([15, 31], [1, 3, 5, 7], [63])
    """
    if heads_per_kv_head < 1:
        raise ValueError(f"query heads per KV head must be at least 1, got {heads_per_kv_head}")
    return [d for d in range(1, up_to + 1) if heads_per_kv_head * (1 + d) % _TILE_ROWS == 0]


def curve_from_slices(key_slices: Iterable[SliceStats], bundle_slices: Iterable[SliceStats], mechanism: str,
                      min_rounds: int = _DEFAULT_MIN_ROUNDS) -> DraftLengthCurve:
    """The curve of one key: its slices' position counts, priced by its bundle's step-cost model."""
    survival = PositionSurvival.from_stats(merge_all(key_slices, sketches=False))
    return draft_length_curve(survival, StepCost.fit(bundle_slices, mechanism), min_rounds)
