"""HybridAdamW (see :mod:`hytrain.hybrid`, where it lives); kept as an import path."""

from .hybrid import HybridAdamW

__all__ = ["HybridAdamW"]
