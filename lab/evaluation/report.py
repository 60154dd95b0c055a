"""Summaries of an evaluation run: the side-by-side table, false-alarm rates, targets met; pure,
results in, one JSON-able summary out, and its text rendering."""

from __future__ import annotations

from .suite import DETECTORS

__all__ = ["summarize", "format_report", "plot_sweep"]

_SECONDS_PER_HOUR = 3600.0
# A bound below the slice and its lateness cannot be approached: decisions leave stage 2 when
# a slice closes. The 2x-bound target applies above it.
_GRANULARITY_S = 2.0
_BOUND_FACTOR = 2.0
_ALARM_FIELDS = ("reason", "bucket", "cohort", "action")  # shown of specwatch's alarm
_DETECTOR_TITLES = {"specwatch": "specwatch", "kill_switch": "kill switch (TRT-LLM)",
                    "prometheus": "Prometheus alert"}


def summarize(results: list[dict], baselines: dict, mode: str) -> dict:
    """One JSON object: settings, the per-incident table, false-alarm rates, targets and rollouts."""
    rollouts = [r for r in results if "expect_freeze" in r]
    results = [r for r in results if "expect_freeze" not in r]
    table = []
    for result in results:
        for row in result["incidents"]:
            entry = {**{k: result[k] for k in ("scenario", "intensity", "label", "case")},
                     "measured_from": row["measured_from"], "target_s": row["target_s"],
                     "workers": result["workers"], "concurrency": result["concurrency"],
                     **{k: row.get(k) for k in ("key_requests_per_minute", "bound", "watched_s")},
                     "compare_baselines": result.get("compare_baselines", True)}
            for detector in DETECTORS:
                entry[detector] = {"verdict": row[detector]["verdict"], "delay_s": row[detector]["delay_s"]}
            alarm = row["specwatch"]["alarm"] or {}
            entry["specwatch"].update({k: alarm.get(k) for k in _ALARM_FIELDS})
            sw = row["specwatch"]
            entry["target_met"] = None if row["target_s"] is None else (
                sw["verdict"] == "right" and sw["delay_s"] <= row["target_s"])
            entry["within_bound"] = _within_bound(entry)
            entry["faster_than_baselines"] = _faster(entry) if entry["compare_baselines"] else None
            table.append(entry)
    return {
        "mode": mode, "baselines": baselines, "table": table,
        "false_alarms": _false_alarms(results),
        "healthy_runs": [
            {"case": r["case"], "scenario": r["scenario"], "label": r["label"], "workers": r["workers"],
             "concurrency": r["concurrency"], "simulated_hours": round(r["simulated_seconds"] / _SECONDS_PER_HOUR, 3),
             **{d: len(r["false_alarms"][d]["alarms"]) for d in DETECTORS},
             "baseline_headroom": r.get("baseline_headroom")}
            for r in results if r["healthy"]],
        "cases": results,
        "notes": _notes(results),
        "rollouts": _rollouts(rollouts),
    }


def _rollouts(runs: list[dict]) -> dict:
    """Closed-loop rollouts under admission: false freezes and alerts, incidents frozen."""
    healthy = [r for r in runs if not r["expect_freeze"]]
    incidents = [r for r in runs if r["expect_freeze"]]
    return {
        "healthy_runs": {s: sum(r["scenario"] == s for r in healthy) for s in sorted({r["scenario"] for r in healthy})},
        "false_freezes": sum(len(r["freezes"]) for r in healthy),
        "false_alerts": sum(len(r["alerts"]) for r in healthy),
        "false_fallbacks": sum(len(r["fallbacks"]) for r in healthy),
        "incidents": {s: [sum(r["scenario"] == s and r["ok"] for r in incidents), sum(r["scenario"] == s
                                                                                   for r in incidents)]
                      for s in sorted({r["scenario"] for r in incidents})},
        "runs": runs,
    }


def _notes(results: list[dict]) -> list[str]:
    """What the reader must know to weigh the numbers: the fleet sizes the incident-free runs cover."""
    levels = sorted({(r["workers"], r["concurrency"]) for r in results if r["healthy"]})
    hours = {level: sum(r["simulated_seconds"] for r in results if r["healthy"]
                        and (r["workers"], r["concurrency"]) == level) / _SECONDS_PER_HOUR for level in levels}
    return [f"incident-free: {hours[(w, c)]:.2f} h on {w} workers x {c} running requests" for w, c in levels]


def _within_bound(entry: dict) -> bool | None:
    """Delay at most twice the information bound; None where the bound is under the slice
    granularity, unknown, or longer than half the watch (no verdict possible)."""
    bound = entry["bound"]
    if bound is None or bound["seconds"] <= _GRANULARITY_S:
        return None
    sw = entry["specwatch"]
    if sw["verdict"] == "right":
        return sw["delay_s"] <= _BOUND_FACTOR * bound["seconds"]
    if entry["watched_s"] is not None and entry["watched_s"] < _BOUND_FACTOR * bound["seconds"]:
        return None
    return False


def _faster(entry: dict) -> bool | None:
    """Whether specwatch acted right and sooner than every baseline that alarmed at all."""
    mine = entry["specwatch"]
    others = [entry[d]["delay_s"] for d in DETECTORS[1:] if entry[d]["delay_s"] is not None]
    if not others:
        return None
    if mine["verdict"] != "right":
        return False
    return all(mine["delay_s"] < other for other in others)


def _false_alarms(results: list[dict]) -> dict:
    """Per detector: alarms in incident-free runs and before incidents, per simulated hour."""
    healthy = [r for r in results if r["healthy"]]
    others = [r for r in results if not r["healthy"]]
    healthy_s = sum(r["simulated_seconds"] for r in healthy)
    bucket_s = sum(r["simulated_seconds"] * r["buckets"] for r in healthy)
    pre_s = sum(r["incident_free_seconds"] for r in others)
    hours = (healthy_s + pre_s) / _SECONDS_PER_HOUR
    out = {"incident_free_hours": round(healthy_s / _SECONDS_PER_HOUR, 3),
           "incident_free_bucket_hours": round(bucket_s / _SECONDS_PER_HOUR, 2),
           "pre_incident_hours": round(pre_s / _SECONDS_PER_HOUR, 3)}
    for detector in DETECTORS:
        free = sum(len(r["false_alarms"][detector]["alarms"]) for r in healthy)
        before = sum(r["false_alarms"][detector]["before_incident"] for r in others)
        after = sum(r["false_alarms"][detector]["after_incident"] for r in others)
        out[detector] = {"incident_free_runs": free, "before_incidents": before,
                         "wrong_during_incidents": after,
                         "per_hour": round((free + before) / hours, 3) if hours else None}
    return out


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _cell(result: dict) -> str:
    if result["delay_s"] is None:
        return result["verdict"]
    return f"{result['delay_s']:7.1f}s {result['verdict']}"


def format_report(summary: dict) -> str:
    """The side-by-side table and the false-alarm rates as text."""
    b = summary["baselines"]
    ks, prom = b["kill_switch"], b["prometheus"]
    header = (f"{'scenario':<18}{'intensity':<26}{'fleet':>7}{'req/min':>8}  {'specwatch':<24}{'bound':>9}"
              f"{'<=2x':>6}  {'kill switch':<22}{'prometheus':<22}{'target':>8}")
    lines = [f"healthy fleet acceptance rate {b['healthy_acceptance_rate']:.3f} (accepted/drafted tokens); "
             f"both baseline thresholds = rate - {b['margin']:.2f}",
             f"kill switch: rolling mean of per-iteration acceptance over {ks['window_iterations']} iterations "
             f"< {ks['threshold']:.2f}, per worker, permanent",
             f"prometheus:  accepted/draft token rate over {prom['rate_range_seconds']:.0f} s "
             f"< {prom['threshold']:.2f} for {prom['for_seconds']:.0f} s, fleet-wide, evaluated every "
             f"{prom['scrape_and_eval_interval_seconds']:.0f} s",
             "", header, "-" * len(header)]
    for entry in summary["table"]:
        target = ""
        if entry["target_s"] is not None:
            target = f"{'met' if entry['target_met'] else 'MISSED'} {entry['target_s']:g}s"
        label = entry["label"] + (" *" if entry["measured_from"] == "first_mismatch_record" else "")
        fleet = f"{entry['workers']}x{entry['concurrency']}"
        rate = "-" if entry["key_requests_per_minute"] is None else f"{entry['key_requests_per_minute']:.0f}"
        bound = "-" if entry["bound"] is None else f"{entry['bound']['seconds']:.1f}s"
        within = {True: "yes", False: "NO", None: "-"}[entry["within_bound"]]
        others = [_cell(entry[d]) if entry["compare_baselines"] else "-" for d in DETECTORS[1:]]
        lines.append(f"{entry['scenario']:<18}{label:<26}{fleet:>7}{rate:>8}  {_cell(entry['specwatch']):<24}"
                     f"{bound:>9}{within:>6}  {others[0]:<22}{others[1]:<22}{target:>8}")
    fa = summary["false_alarms"]
    lines += ["delay: event time from the incident start to the first alarm (* from the first mismatch record);",
              "req/min: finished requests per minute of the incident's key before it; bound: the delay an ideal "
              "CUSUM with specwatch's false-alarm rate needs (ln ARL / KL per observation);",
              "specwatch decisions are timed when they can be acted on: when their slice closes, at slice end + "
              "lateness.",
              "",
              f"false alarms: {fa['incident_free_hours']:.2f} h incident-free "
              f"({fa['incident_free_bucket_hours']:.1f} bucket-hours) + {fa['pre_incident_hours']:.2f} h "
              "before incidents",
              f"{'detector':<24}{'incident-free':>14}{'pre-incident':>14}{'per hour':>10}{'wrong during incidents':>24}"]
    for detector in DETECTORS:
        row = fa[detector]
        lines.append(f"{_DETECTOR_TITLES[detector]:<24}{row['incident_free_runs']:>14}{row['before_incidents']:>14}"
                     f"{row['per_hour']:>10.3f}{row['wrong_during_incidents']:>24}")
    ro = summary.get("rollouts") or {}
    if ro.get("runs"):
        lines += ["", "rollouts under admission (closed loop, the documented admission policy):",
                  f"  healthy: {ro['healthy_runs']}: false freezes {ro['false_freezes']}, false alerts "
                  f"{ro['false_alerts']}, other fallbacks {ro['false_fallbacks']}"]
        for scenario, (frozen, total) in ro["incidents"].items():
            lines.append(f"  {scenario}: frozen in {frozen} of {total} runs")
    lines += ["", "incident-free runs:", *(f"  note: {note}" for note in summary.get("notes", []))]
    for run in summary["healthy_runs"]:
        alarms = ", ".join(f"{_DETECTOR_TITLES[d]} {run[d]}" for d in DETECTORS)
        lines.append(f"  {run['scenario']:<10} {run['simulated_hours']:6.2f} h  {run['workers']} workers x "
                     f"{run['concurrency']} running  ({run['label']}): {alarms}")
        headroom = run.get("baseline_headroom") or {}
        if headroom.get("kill_switch_lowest_rolling_rate") is not None:
            lines.append(f"  {'':<10} closest the baselines came: kill switch rolling rate "
                         f"{headroom['kill_switch_lowest_rolling_rate']:.3f}, alert ratio "
                         f"{_number(headroom.get('prometheus_lowest_ratio'))} (thresholds "
                         f"{headroom['kill_switch_threshold']:.2f})")
    return "\n".join(lines)


def plot_sweep(summary: dict, path) -> None:
    """Delay against the incident key's requests per minute, one line per incident kind, bound beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_kind: dict[tuple[str, str], list[dict]] = {}
    for entry in summary["table"]:
        if entry["key_requests_per_minute"]:
            by_kind.setdefault((entry["scenario"], entry["label"]), []).append(entry)
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((kind, label), entries) in enumerate(sorted(by_kind.items())):
        entries.sort(key=lambda e: e["key_requests_per_minute"])
        color = colors[i % len(colors)]
        hit = [e for e in entries if e["specwatch"]["verdict"] == "right"]
        ax.plot([e["key_requests_per_minute"] for e in hit], [e["specwatch"]["delay_s"] for e in hit], "o-",
                color=color, label=f"{label}")
        bounded = [e for e in entries if e["bound"]]
        if bounded:
            ax.plot([e["key_requests_per_minute"] for e in bounded], [e["bound"]["seconds"] for e in bounded],
                    "--", color=color, alpha=0.6)
        missed = [e for e in entries if e["specwatch"]["verdict"] != "right"]
        ax.plot([e["key_requests_per_minute"] for e in missed], [e["watched_s"] or 1.0 for e in missed], "x",
                color=color, markersize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("finished requests per minute of the incident's key")
    ax.set_ylabel("delay to a right decision (s)")
    ax.set_title("Detection delay against traffic (dashed: information bound; x: not decided within the watch)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    from specwatch.outputs import save_figure

    save_figure(fig, path)
    plt.close(fig)
