"""hytrain: a heterogeneous CPU+GPU training engine for PyTorch.

fp32 master weights and Adam states live in (pinned) host memory and are updated by a vectorised,
multi-threaded CPU AdamW, while the GPU keeps only the bf16/fp16 training copy.
"""

from __future__ import annotations

from ._native import native
from .copies import CopyStream
from .cpu_adam import adamw_step, set_simd_path, simd_paths
from .cuda_adam import CudaAdamW
from .grad_norm import CudaGradNorm, clip_multiplier
from .hybrid import HybridAdamW
from .pool import CapacityError, PinnedPool
from .window import WeightWindow, stream_model
from . import integrations  # imports transformers or Lightning only when they are used

__version__ = "0.1.0"


def build_info() -> dict:
    """Version, CUDA version and architectures (or None), SIMD paths, OpenMP of the native build."""
    return dict(native().build_info())


def cuda_available() -> bool:
    """True when the native build has CUDA and a GPU is usable."""
    return bool(native().cuda_available())


def __getattr__(name):
    if name == "PoolExhaustedError":
        return native().PoolExhaustedError
    if name == "DeviceTimeoutError":
        return native().DeviceTimeoutError
    raise AttributeError(f"module 'hytrain' has no attribute {name!r}")


__all__ = ["CapacityError", "CopyStream", "CudaAdamW", "CudaGradNorm", "DeviceTimeoutError", "HybridAdamW", "PinnedPool",
           "PoolExhaustedError", "adamw_step", "build_info", "clip_multiplier", "cuda_available",
           "set_simd_path", "simd_paths", "stream_model", "WeightWindow", "__version__"]
