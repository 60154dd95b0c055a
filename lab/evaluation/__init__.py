"""Detection quality: seeded incident and incident-free runs, specwatch against operator baselines
(`specwatch evaluate`); the baselines are pure detectors usable on their own."""

from .baselines import AcceptanceKillSwitch, PrometheusRatioAlert
from .bounds import bernoulli_kl, information_bound
from .report import format_report, plot_sweep, summarize
from .scoring import Alarm, Verdict, judge, stray_alarms
from .suite import LEVELS, TARGETS, BaselineSettings, Case, calibrate, full_suite, quick_suite, run_case, run_suite

__all__ = ["LEVELS", "TARGETS", "AcceptanceKillSwitch", "Alarm", "BaselineSettings", "Case",
           "PrometheusRatioAlert", "Verdict", "calibrate", "bernoulli_kl", "format_report",
           "information_bound", "plot_sweep", "full_suite", "judge", "quick_suite", "run_case",
           "run_suite", "stray_alarms", "summarize"]
