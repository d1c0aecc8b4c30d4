"""hytrain: a heterogeneous CPU+GPU training engine for PyTorch.

fp32 master weights and Adam states live in (pinned) host memory and are updated by a vectorised,
multi-threaded CPU AdamW, while the GPU keeps only the bf16/fp16 training copy.
"""

from __future__ import annotations

from . import early_signals

early_signals.install()  # first: a job's process notes a SIGUSR1 while it is still importing (early_signals.py)

from ._native import native  # noqa: E402
from .copies import CopyStream
from .cpu_adam import adamw_step, set_simd_path, simd_paths
from .cuda_adam import CudaAdamW
from .grad_norm import CudaGradNorm, clip_multiplier
from .hybrid import HybridAdamW
from .checkpoint import CheckpointError
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


# The native module's exceptions, resolved at first use (``import hytrain`` works without the native
# build, which native() then explains); the classes carry the same docstrings (pool.py).
PoolExhaustedError: type
"""A host allocation failed: a :class:`PinnedPool` asked for more than its capacity left free, or the system
refused the memory (page-locked or not). A ``MemoryError`` raised by the allocation itself, not checked
beforehand as :class:`CapacityError` is; its message names the bytes requested and available. Raise the
pool's capacity (``hytrain train --pin-limit``) or train a smaller model. The class is
``hytrain_native.PoolExhaustedError``, also reached as ``hytrain.PoolExhaustedError``."""

DeviceTimeoutError: type
"""A wait on device work passed its deadline: a ``TimeoutError`` raised by a wait given a timeout
(``CopyStream.wait(timeout=...)``, the native ``OffloadPipeline.wait_ready(..., timeout_s)``; HybridAdamW
waits without one), naming what had not finished (a copy ticket and how many copies were done, or a
block not yet updated). The work itself goes on. The class is ``hytrain_native.DeviceTimeoutError``,
also reached as ``hytrain.DeviceTimeoutError``."""


def __getattr__(name):
    if name == "PoolExhaustedError":
        return native().PoolExhaustedError
    if name == "DeviceTimeoutError":
        return native().DeviceTimeoutError
    raise AttributeError(f"module 'hytrain' has no attribute {name!r}")


__all__ = ["CapacityError", "CheckpointError", "CopyStream", "CudaAdamW", "CudaGradNorm", "DeviceTimeoutError",
           "HybridAdamW", "PinnedPool", "PoolExhaustedError", "adamw_step", "build_info", "clip_multiplier",
           "cuda_available", "set_simd_path", "simd_paths", "stream_model", "WeightWindow", "__version__"]
