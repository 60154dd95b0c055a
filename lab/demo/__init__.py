"""What demos and engine tests run on: `specwatch demo --engine vllm` and the tiny local models.

Importable without vLLM installed; vLLM is imported only when a demo starts an engine.
"""
