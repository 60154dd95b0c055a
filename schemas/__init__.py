"""Contract-v1 telemetry records, decisions and policy configuration, with their codecs."""

from .codec import (MAX_LINE_BYTES, Rejection, RejectionCounter, decode_line, decode_object, encode_record,
                    read_json_lines)
from .contract import (CONTRACT_VERSION, MAX_REQUESTS_PER_STEP, BundleCard, BundleRecord, DrafterCard, PolicyCard,
                       RequestRecord, RoundEntry, RuntimeCard, Sample, Sampling, ShadowRecord, StepRecord, TargetCard,
                       TelemetryRecord, bundle_digest, card_differences)
from .decisions import Decision, decision_id, decision_key
from .policy import Policy, PolicyError, load_policy

__all__ = ["CONTRACT_VERSION", "MAX_LINE_BYTES", "MAX_REQUESTS_PER_STEP", "BundleCard", "BundleRecord", "Decision",
           "DrafterCard", "Policy", "PolicyCard", "PolicyError", "Rejection", "RejectionCounter", "RequestRecord",
           "RoundEntry", "RuntimeCard", "Sample", "Sampling", "ShadowRecord", "StepRecord", "TargetCard",
           "TelemetryRecord", "bundle_digest", "card_differences", "decision_id", "decision_key", "decode_line",
           "read_json_lines", "decode_object", "encode_record", "load_policy"]
