"""Gate 1, quality invariants with speed not scored: greedy outputs identical request by request,
sampled outputs equal in distribution (power stated), AL per bucket, task checks on both paths and
the stress slices. Pure: completions in, a `GateResult` out."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from specwatch.schemas.rerun import first_divergence
from specwatch.detectors.draft_length import PositionSurvival
from specwatch.schemas.slice_stats import SliceStats, round_evidence
from specwatch.schemas.qualification import GateResult

from .checks import CodeRunner, run_checks, run_code_test
from .completion import Completion
from .dataset import QualificationRequest

__all__ = ["DEFAULT_ALPHA", "DEFAULT_EFFECT_W", "DEFAULT_POSITIONS", "acceptance_by_bucket", "distribution_test", "judge_gate1",
           "per_position_counts", "rounds_stats"]

DEFAULT_ALPHA = 0.01
"""Family-wise false-alarm rate of the distribution tests (Bonferroni over positions and requests)."""
DEFAULT_POSITIONS = 4
"""Output positions whose token distributions are compared: the first comes from the prefill, the
next ones from the first speculative step (a drafter's tokens, accepted or replaced)."""
DEFAULT_EFFECT_W = 0.3
"""The effect the power is stated for: Cohen's w 0.3 ("medium"), e.g. 20 % of the draws moved from
one of two equally likely tokens to the other."""
_POWER = 0.8
_MIN_EXPECTED = 5  # chi-square cells with fewer expected counts are pooled into one (Cochran's rule)
_LONG_PROMPT_TOKENS = 256
_LONG_OUTPUT_TOKENS = 64


def rounds_stats(completions: Iterable[Completion]) -> SliceStats:
    """The speculative rounds of ``completions`` folded as the pipeline folds steps (one AL formula)."""
    stats = SliceStats()
    for completion in completions:
        for drafted, accepted in completion.rounds:
            stats.add_round(drafted, accepted)
    return stats


def acceptance_by_bucket(requests: Sequence[QualificationRequest], speculative: Sequence[Completion]) -> dict:
    """Per bucket: AL over all rounds, p10/p50/p90 of the requests' AL, and acceptance per position.

    >>> from specwatch.qualify.dataset import QualificationRequest as R
    >>> reqs = [R(id="a", bucket="coding", prompt="x"), R(id="b", bucket="coding", prompt="y")]
    >>> spec = [Completion("a", "speculative", 0, rounds=[(3, 3), (3, 1)]), Completion("b", "speculative", 0, rounds=[(3, 0)])]
    >>> out = acceptance_by_bucket(reqs, spec)["coding"]
    >>> out["mean"], out["p50"], out["rounds"], out["position_acceptance"]
    (2.33333, 2.0, 3, [0.666667, 0.333333, 0.333333])
    """
    bucket_of = {r.id: r.bucket for r in requests}
    by_bucket: dict[str, list[Completion]] = defaultdict(list)
    for completion in speculative:
        if completion.error is None and completion.rounds:
            by_bucket[bucket_of[completion.request_id]].append(completion)
    out = {}
    for bucket in sorted(by_bucket):
        merged = rounds_stats(by_bucket[bucket])
        per_request = np.array([rounds_stats([c]).acceptance_length for c in by_bucket[bucket]])
        p10, p50, p90 = np.quantile(per_request, [0.1, 0.5, 0.9])
        survival = PositionSurvival.from_stats(merged)
        out[bucket] = {"mean": round_evidence(merged.acceptance_length), "p10": round_evidence(float(p10)),
                       "p50": round_evidence(float(p50)), "p90": round_evidence(float(p90)),
                       "rounds": merged.rounds, "requests": len(per_request),
                       "position_acceptance": [round_evidence(x) for x in survival.rates()],
                       "accepted_at_least": list(merged.accepted_at_least),
                       "drafted_at_least": list(merged.drafted_at_least)}
    return out


def _noncentrality_for_power(df: int, alpha: float, power: float) -> float:
    """The noncentrality at which a chi-square test with ``df`` degrees of freedom at level ``alpha``
    rejects with probability ``power``."""
    critical = scipy_stats.chi2.ppf(1 - alpha, df)
    low, high = 0.0, 1e4
    for _ in range(100):
        mid = (low + high) / 2
        if scipy_stats.ncx2.sf(critical, df, mid) < power:
            low = mid
        else:
            high = mid
    return high


def _power(df: int, n: int, alpha: float, w: float) -> float:
    """Probability that the test on ``n`` draws rejects when the true effect is Cohen's ``w``."""
    return float(scipy_stats.ncx2.sf(scipy_stats.chi2.ppf(1 - alpha, df), df, n * w * w))


def distribution_test(standard: Sequence[Sequence[int]], speculative: Sequence[Sequence[int]], alpha: float,
                      positions: int = DEFAULT_POSITIONS, effect_w: float = DEFAULT_EFFECT_W) -> dict:
    """Chi-square homogeneity of the token drawn at each of the first ``positions`` outputs, the two
    paths' draws as two independent samples (each draw is its own request with its own seed), tokens
    with fewer than 5 expected draws pooled into one cell (itself joined to the rarest kept
    token's when it is that thin); ``alpha`` is this request's share of the
    family, split over the positions. Each tested position states its power against Cohen's
    ``effect_w`` and the smallest w it detects with power 0.8; ``conclusive`` is False when no
    position reaches power 0.8 at ``effect_w`` (too few draws, or too few distinct tokens: a
    near-uniform distribution over a large vocabulary pools into one cell and cannot be compared).

    >>> rng = np.random.default_rng(3)
    >>> same = lambda: [list(rng.choice(4, size=3, p=[.4, .3, .2, .1])) for _ in range(200)]
    >>> result = distribution_test(same(), same(), alpha=0.01)
    >>> result["rejected"], result["conclusive"], result["per_position"][0]["power"]
    (False, True, 0.992357)
    >>> other = [list(rng.choice(4, size=3, p=[.1, .2, .3, .4])) for _ in range(200)]
    >>> result = distribution_test(same(), other, alpha=0.01)
    >>> result["rejected"], result["first_position"]
    (True, 0)
    >>> flat = lambda: [list(rng.choice(2000, size=3)) for _ in range(50)]  # every cell pooled: no test
    >>> result = distribution_test(flat(), flat(), alpha=0.01)
    >>> result["rejected"], result["conclusive"], result["positions_tested"]
    (False, False, 0)
    """
    level = alpha / positions
    per_position, first, tested = [], None, 0
    for position in range(positions):
        a = [s[position] for s in standard if len(s) > position]
        b = [s[position] for s in speculative if len(s) > position]
        if len(a) < _MIN_EXPECTED or len(b) < _MIN_EXPECTED:
            continue
        counts_a, counts_b = Counter(a), Counter(b)
        total = len(a) + len(b)
        kept = sorted(t for t in set(counts_a) | set(counts_b)
                      if (counts_a[t] + counts_b[t]) * min(len(a), len(b)) / total >= _MIN_EXPECTED)
        columns = [[counts_a[t], counts_b[t]] for t in kept]
        pooled = [len(a) - sum(c[0] for c in columns), len(b) - sum(c[1] for c in columns)]
        if sum(pooled) * min(len(a), len(b)) / total >= _MIN_EXPECTED or not columns:
            columns.append(pooled)
        else:  # too thin a cell on its own: it joins the rarest kept token's
            rarest = min(columns, key=sum)
            rarest[0] += pooled[0]
            rarest[1] += pooled[1]
        table = [col for col in columns if sum(col) > 0]
        if len(table) < 2:
            per_position.append({"position": position, "p_value": 1.0, "categories": len(table)})
            continue
        _, p_value, df, _ = scipy_stats.chi2_contingency(np.array(table).T, correction=False)
        tested += 1
        per_position.append({
            "position": position, "p_value": round_evidence(float(p_value)), "categories": len(table),
            "power": round_evidence(_power(int(df), total, level, effect_w)),
            "detectable_w": round_evidence(math.sqrt(_noncentrality_for_power(int(df), level, _POWER) / total))})
    rejected = [p for p in per_position if p["p_value"] < level]
    if rejected:
        first = rejected[0]["position"]
    best_power = max((p["power"] for p in per_position if "power" in p), default=0.0)
    return {"rejected": bool(rejected), "first_position": first, "draws": [len(standard), len(speculative)],
            "positions_tested": tested, "level": round_evidence(level), "effect_w": effect_w,
            "power": best_power, "conclusive": bool(rejected) or best_power >= _POWER,
            "per_position": per_position}


def _greedy_verdict(request: QualificationRequest, standard: Completion, speculative: Completion) -> dict:
    position = first_divergence(standard.token_ids, speculative.token_ids)
    row = {"id": request.id, "bucket": request.bucket, "identical": position is None,
           "output_tokens": [len(standard.token_ids), len(speculative.token_ids)]}
    if position is not None:
        row.update(first_divergence=position,
                   standard_token=standard.token_ids[position] if position < len(standard.token_ids) else None,
                   speculative_token=(speculative.token_ids[position]
                                      if position < len(speculative.token_ids) else None))
    return row


def _slices(request: QualificationRequest, completion: Completion) -> dict[str, str]:
    """The stress-layer slices a request falls in: prompt length, output length, how it stops."""
    sampling = request.sampling
    return {"prompt": "long" if completion.prompt_tokens >= _LONG_PROMPT_TOKENS else "short",
            "output": "long" if sampling.max_tokens > _LONG_OUTPUT_TOKENS else "short",
            "stop": ("stop_strings" if sampling.stop else "length_only" if sampling.ignore_eos else "eos")}


def judge_gate1(requests: Sequence[QualificationRequest], completions: Sequence[Completion],
                alpha: float = DEFAULT_ALPHA, code_runner: CodeRunner = run_code_test,
                effect_w: float = DEFAULT_EFFECT_W, skipped: Sequence[dict] = ()) -> GateResult:
    """Gate 1's verdict over both paths' completions; every failure is named with its request and bucket.

    Fails on: a greedy output that differs (first divergent token named), a sampled request whose
    distributions differ, a check that passes on standard decoding and fails on the speculative path,
    and a request that errs only on the speculative path. Neither a sampled test without power at
    ``effect_w`` (inconclusive) nor a ``skipped`` request (``context_overflow``) passes or fails it.
    """
    by_key: dict[tuple[str, str], list[Completion]] = defaultdict(list)
    for completion in completions:
        by_key[completion.request_id, completion.path].append(completion)
    sampled = [r for r in requests if not r.sampling.greedy]
    family = max(1, len(sampled))
    reasons, greedy_rows, distribution_rows = [], [], []
    checks: dict[tuple[str, str], Counter] = defaultdict(Counter)
    slices: dict[tuple[str, str], Counter] = defaultdict(Counter)
    errors = Counter()
    for request in requests:
        standard = sorted(by_key[request.id, "standard"], key=lambda c: c.sample)
        speculative = sorted(by_key[request.id, "speculative"], key=lambda c: c.sample)
        failed_std = [c for c in standard if c.error]
        failed_spec = [c for c in speculative if c.error]
        errors["standard"] += len(failed_std)
        errors["speculative"] += len(failed_spec)
        if len(failed_spec) > len(failed_std):
            reasons.append(f"{request.id} ({request.bucket}): {len(failed_spec)} speculative request(s) failed "
                           f"against {len(failed_std)} standard: {failed_spec[0].error}")
        standard = [c for c in standard if not c.error]
        speculative = [c for c in speculative if not c.error]
        if not standard or not speculative:
            continue
        if request.sampling.greedy:
            row = _greedy_verdict(request, standard[0], speculative[0])
            greedy_rows.append(row)
            for name, value in _slices(request, standard[0]).items():
                slices[name, value]["requests"] += 1
                slices[name, value]["identical"] += row["identical"]
            if not row["identical"]:
                reasons.append(f"{request.id} ({request.bucket}): greedy output diverges at token "
                               f"{row['first_divergence']} (standard {row['standard_token']}, "
                               f"speculative {row['speculative_token']})")
        else:
            test = distribution_test([c.token_ids for c in standard], [c.token_ids for c in speculative],
                                     alpha / family, effect_w=effect_w)
            distribution_rows.append(dict(test, id=request.id, bucket=request.bucket))
            if test["rejected"]:
                p = min(x["p_value"] for x in test["per_position"])
                reasons.append(f"{request.id} ({request.bucket}): sampled token distribution differs at output "
                               f"position {test['first_position']} (p = {p:.2g} < {test['level']:.2g})")
        # checks: a pass on standard decoding and a fail on the speculative path is unacceptable
        std_results = [run_checks(request.checks, c.text, c.finish_reason, code_runner) for c in standard]
        spec_results = [run_checks(request.checks, c.text, c.finish_reason, code_runner) for c in speculative]
        for name in request.check_names:
            std_pass = sum(r[name] is None for r in std_results)
            spec_pass = sum(r[name] is None for r in spec_results)
            counter = checks[request.bucket, name]
            counter.update(requests=1, standard_pass=std_pass, standard_runs=len(std_results),
                           speculative_pass=spec_pass, speculative_runs=len(spec_results))
            if _check_regressed(std_pass, len(std_results), spec_pass, len(spec_results), alpha / family):
                why = next(r[name] for r in spec_results if r[name] is not None)
                reasons.append(f"{request.id} ({request.bucket}): check {name} passes on standard decoding "
                               f"({std_pass}/{len(std_results)}) and fails on the speculative path "
                               f"({spec_pass}/{len(spec_results)}): {why}")
    speculative_all = [c for c in completions if c.path == "speculative"]
    detail = {
        "greedy": {"requests": len(greedy_rows), "identical": sum(r["identical"] for r in greedy_rows),
                   "divergences": [r for r in greedy_rows if not r["identical"]]},
        "sampled": {"requests": len(distribution_rows), "rejected": sum(r["rejected"] for r in distribution_rows),
                    "inconclusive": [r["id"] for r in distribution_rows if not r["conclusive"]],
                    "alpha": alpha, "power": _POWER, "effect_w": effect_w, "tests": distribution_rows},
        "acceptance": acceptance_by_bucket(requests, speculative_all),
        "checks": [dict(counter, bucket=bucket, check=name) for (bucket, name), counter in sorted(checks.items())],
        "stress": [dict(counter, slice=name, value=value) for (name, value), counter in sorted(slices.items())],
        "errors": dict(errors), "skipped": list(skipped),
    }
    if not greedy_rows and not distribution_rows:
        reasons.append("no request completed on both paths: nothing was compared" + _skipped_note(skipped))
    return GateResult(verdict="fail" if reasons else "pass", reasons=reasons, detail=detail)


def _skipped_note(skipped: Sequence[dict]) -> str:
    return f" ({len(skipped)} skipped as longer than the servers hold)" if skipped else ""


def _check_regressed(std_pass: int, std_runs: int, spec_pass: int, spec_runs: int, alpha: float) -> bool:
    """A greedy request: passed on standard, failed speculative. Sampled: fewer passes, by Fisher's test."""
    if std_runs == spec_runs == 1:
        return std_pass == 1 and spec_pass == 0
    if spec_pass * std_runs >= std_pass * spec_runs:
        return False
    table = [[std_pass, std_runs - std_pass], [spec_pass, spec_runs - spec_pass]]
    return scipy_stats.fisher_exact(table, alternative="greater").pvalue < alpha


def per_position_counts(acceptance: Mapping[str, dict]) -> PositionSurvival:
    """All buckets' per-position counts merged: where `tune` can start from."""
    accepted: list[int] = []
    drafted: list[int] = []
    for row in acceptance.values():
        for into, values in ((accepted, row["accepted_at_least"]), (drafted, row["drafted_at_least"])):
            into.extend([0] * (len(values) - len(into)))
            for i, v in enumerate(values):
                into[i] += v
    return PositionSurvival.from_counts(accepted, drafted)
