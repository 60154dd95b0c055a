"""specwatch: always-on monitor and safety switch for speculative decoding in LLM serving."""

__version__ = "0.1.0"
