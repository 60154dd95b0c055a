"""Detection quality: seeded incident and incident-free runs, specwatch against operator baselines.

`specwatch evaluate` runs the suite; the baselines are pure detectors usable on their own.
"""

from .baselines import AcceptanceKillSwitch, PrometheusRatioAlert
from .report import format_report, summarize
from .scoring import Alarm, Verdict, judge, stray_alarms
from .suite import TARGETS, BaselineSettings, Case, calibrate, full_suite, quick_suite, run_case, run_suite

__all__ = [
    "TARGETS",
    "AcceptanceKillSwitch",
    "Alarm",
    "BaselineSettings",
    "Case",
    "PrometheusRatioAlert",
    "Verdict",
    "calibrate",
    "format_report",
    "full_suite",
    "judge",
    "quick_suite",
    "run_case",
    "run_suite",
    "stray_alarms",
    "summarize",
]
