"""Detectors: rolling per-key statistics, baselines, gates and drift detection. Pure code, no I/O."""
