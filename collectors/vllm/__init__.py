"""The vLLM V1 engine integration: per-step telemetry and in-engine fallback.

Importable without vLLM installed; vLLM is imported only when an engine is tapped or built.
"""

from .bundle import describe_bundle
from .collector import (BUCKET_ARG, COHORT_ARG, DEFAULT_BUCKET, DEFAULT_COHORT, CollectorStats,
                        VllmCollector, request_labels)

__all__ = ["BUCKET_ARG", "COHORT_ARG", "DEFAULT_BUCKET", "DEFAULT_COHORT", "CollectorStats",
           "VllmCollector", "describe_bundle", "request_labels"]
