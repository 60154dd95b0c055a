"""Summaries of an evaluation run: the side-by-side table, false-alarm rates, targets met.

Pure: results in, one JSON-able summary out, and its text rendering.
"""

from __future__ import annotations

from .suite import DETECTORS

__all__ = ["summarize", "format_report"]

_SECONDS_PER_HOUR = 3600.0
_DETECTOR_TITLES = {"specwatch": "specwatch", "kill_switch": "kill switch (TRT-LLM)",
                    "prometheus": "Prometheus alert"}


def summarize(results: list[dict], baselines: dict, mode: str) -> dict:
    """One JSON object: settings, the per-incident table, false-alarm rates and targets."""
    table = []
    for result in results:
        for row in result["incidents"]:
            entry = {
                "scenario": result["scenario"],
                "intensity": result["intensity"],
                "label": result["label"],
                "case": result["case"],
                "measured_from": row["measured_from"],
                "target_s": row["target_s"],
            }
            for detector in DETECTORS:
                entry[detector] = {"verdict": row[detector]["verdict"], "delay_s": row[detector]["delay_s"]}
            sw = row["specwatch"]
            entry["target_met"] = None if row["target_s"] is None else (
                sw["verdict"] == "right" and sw["delay_s"] <= row["target_s"])
            entry["faster_than_baselines"] = _faster(entry)
            table.append(entry)
    return {
        "mode": mode,
        "baselines": baselines,
        "table": table,
        "false_alarms": _false_alarms(results),
        "healthy_runs": [
            {"case": r["case"], "scenario": r["scenario"], "label": r["label"], "workers": r["workers"],
             "concurrency": r["concurrency"], "simulated_hours": round(r["simulated_seconds"] / _SECONDS_PER_HOUR, 3),
             **{d: len(r["false_alarms"][d]["alarms"]) for d in DETECTORS},
             "baseline_headroom": r.get("baseline_headroom")}
            for r in results if r["healthy"]],
        "cases": results,
        "notes": _notes(results),
    }


def _notes(results: list[dict]) -> list[str]:
    """What the reader must know to weigh the numbers: runs on a smaller fleet than the default."""
    small = sorted({(r["workers"], r["concurrency"]) for r in results if r["healthy"] and r["workers"] < 8})
    return [f"the long incident-free runs use {w} workers x {c} running requests instead of the default "
            f"8 x 16 (a fraction of the traffic per key), to keep the suite to minutes" for w, c in small]


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
    healthy_s = sum(r["simulated_seconds"] for r in results if r["healthy"])
    bucket_hours = sum(r["simulated_seconds"] * r["buckets"] for r in results if r["healthy"]) / _SECONDS_PER_HOUR
    pre_s = sum(r["incident_free_seconds"] for r in results if not r["healthy"])
    out = {"incident_free_hours": round(healthy_s / _SECONDS_PER_HOUR, 3),
           "incident_free_bucket_hours": round(bucket_hours, 2),
           "pre_incident_hours": round(pre_s / _SECONDS_PER_HOUR, 3)}
    for detector in DETECTORS:
        healthy = sum(len(r["false_alarms"][detector]["alarms"]) for r in results if r["healthy"])
        before = sum(r["false_alarms"][detector]["before_incident"] for r in results if not r["healthy"])
        after = sum(r["false_alarms"][detector]["after_incident"] for r in results if not r["healthy"])
        hours = (healthy_s + pre_s) / _SECONDS_PER_HOUR
        out[detector] = {
            "incident_free_runs": healthy,
            "before_incidents": before,
            "wrong_during_incidents": after,
            "per_hour": round((healthy + before) / hours, 3) if hours else None,
        }
    return out


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _cell(result: dict) -> str:
    if result["delay_s"] is None:
        return result["verdict"]
    return f"{result['delay_s']:7.1f}s {result['verdict']}"


def format_report(summary: dict) -> str:
    """The side-by-side table and the false-alarm rates as text."""
    lines = []
    b = summary["baselines"]
    ks, prom = b["kill_switch"], b["prometheus"]
    lines.append(f"healthy fleet acceptance rate {b['healthy_acceptance_rate']:.3f} (accepted/drafted tokens); "
                 f"both baseline thresholds = rate - {b['margin']:.2f}")
    lines.append(f"kill switch: rolling mean of per-iteration acceptance over {ks['window_iterations']} iterations "
                 f"< {ks['threshold']:.2f}, per worker, permanent")
    lines.append(f"prometheus:  accepted/draft token rate over {prom['rate_range_seconds']:.0f} s "
                 f"< {prom['threshold']:.2f} for {prom['for_seconds']:.0f} s, fleet-wide, evaluated every "
                 f"{prom['scrape_and_eval_interval_seconds']:.0f} s")
    lines.append("")
    header = (f"{'scenario':<18}{'intensity':<26}{'specwatch':<24}{'kill switch':<24}{'prometheus':<24}"
              f"{'target':>8}")
    lines.append(header)
    lines.append("-" * len(header))
    for entry in summary["table"]:
        target = ""
        if entry["target_s"] is not None:
            target = f"{'met' if entry['target_met'] else 'MISSED'} {entry['target_s']:g}s"
        label = entry["label"] + (" *" if entry["measured_from"] == "first_mismatch_record" else "")
        lines.append(f"{entry['scenario']:<18}{label:<26}{_cell(entry['specwatch']):<24}"
                     f"{_cell(entry['kill_switch']):<24}{_cell(entry['prometheus']):<24}{target:>8}")
    lines.append("delay: event time from the incident start to the first alarm (* from the first mismatch record);")
    lines.append("specwatch decisions are timed when they can be acted on: when their slice closes, at slice end + "
                 "lateness.")
    lines.append("")
    fa = summary["false_alarms"]
    lines.append(f"false alarms: {fa['incident_free_hours']:.2f} h incident-free "
                 f"({fa['incident_free_bucket_hours']:.1f} bucket-hours) + {fa['pre_incident_hours']:.2f} h "
                 "before incidents")
    lines.append(f"{'detector':<24}{'incident-free':>14}{'pre-incident':>14}{'per hour':>10}"
                 f"{'wrong during incidents':>24}")
    for detector in DETECTORS:
        row = fa[detector]
        lines.append(f"{_DETECTOR_TITLES[detector]:<24}{row['incident_free_runs']:>14}{row['before_incidents']:>14}"
                     f"{row['per_hour']:>10.3f}{row['wrong_during_incidents']:>24}")
    lines.append("")
    lines.append("incident-free runs:")
    for note in summary.get("notes", []):
        lines.append(f"  note: {note}")
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
