"""The project's own Llama-style decoder, used by tests, benchmarks and ``hytrain train``."""

from .llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
