"""Collectors: telemetry producers inside engine workers (vLLM, the simulated fleet) and their exporters."""
