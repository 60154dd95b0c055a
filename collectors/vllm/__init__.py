"""The vLLM V1 engine integration: per-step telemetry and in-engine fallback."""
