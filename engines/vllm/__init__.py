"""vLLM engines on CPU: one in this process, an OpenAI-compatible server as a child, archived reruns.

Importable without vLLM installed; vLLM is imported only when an engine is built.
"""
