"""The optimizer-state formats: how Adam's m and v are stored (the master weights are fp32 in every
format). Each format is described once, here, and everything else reads this table: HybridAdamW's
``state_format`` and its checks, the buffers' dtype and shape, the bytes capacity planning and
checkpoint sizes count, which features a format has, the state dicts' conversions, the job's
``--state-format``, ``hytrain info``, and the native code that selects the kernels (``DType`` in
``core/include/hytrain/dtype.h``).

Adding a format (docs/architecture.md, "State formats", has the whole recipe): a ``StateFormat`` here
(with the module holding its encoding, as ``quant8`` is 8-bit's), its ``DType`` and kernel traits in
``core/`` and ``cuda/``, and a test module; the rest follows from this table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import quant8


@dataclass(frozen=True)
class StateFormat:
    """One format of m and v. ``dtype``: their buffers' dtype, which also selects the kernels at the
    native API (``cpu_adam.adamw_step``, ``CudaAdamW``); ``code``: its ``hytrain::DType``;
    ``label``: its name in messages; ``blockwise``: flat byte buffers of codes with per-block scales
    (quant8's layout), not tensors shaped like the parameter; ``amsgrad``: keeps amsgrad's fp32 max
    v; ``undo_records``: speculation undoes an update from a record (3 bytes a parameter) instead of
    a copy of the state."""

    name: str
    dtype: torch.dtype
    code: int
    label: str
    summary: str
    blockwise: bool = False
    amsgrad: bool = False
    undo_records: bool = False

    def moment_shape(self, shape) -> tuple:
        """The shape of m's (and v's) buffer for a parameter of ``shape``."""
        return (quant8.state_bytes(math.prod(shape)),) if self.blockwise else tuple(shape)

    def moment_numel(self, n: int) -> int:
        """The elements of m's (and v's) buffer for an n-element parameter."""
        return quant8.state_bytes(n) if self.blockwise else n

    def moment_bytes(self, n: int) -> int:
        """The bytes of m (or v) of an n-element parameter."""
        return self.moment_numel(n) * self.dtype.itemsize

    def bytes_per_parameter(self) -> float:
        """m and v together, per parameter of a large tensor (the block scales included)."""
        n = 1 << 20
        return 2 * self.moment_bytes(n) / n


FORMATS = {f.name: f for f in (
    StateFormat("fp32", torch.float32, 0, "fp32", "m and v in fp32, as torch's AdamW keeps them",
                amsgrad=True, undo_records=True),
    StateFormat("bf16", torch.bfloat16, 1, "bfloat16", "m and v stochastically rounded to bfloat16"),
    StateFormat("8bit", torch.uint8, 3, "8-bit", "m and sqrt(v) blockwise-quantised to 8 bits, one fp32 "
                f"scale a block of {quant8.BLOCK} (hytrain.quant8)", blockwise=True),
)}
DEFAULT = "fp32"
NAMES = tuple(FORMATS)


def get(name) -> StateFormat:
    """The format called ``name``; a ValueError naming the formats otherwise."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"state_format must be one of {', '.join(map(repr, NAMES))}; got {name!r}")
    return fmt


def of_dtype(dtype: torch.dtype) -> StateFormat | None:
    """The format whose buffers have ``dtype`` (the native API tells formats apart by it), or None."""
    return next((f for f in FORMATS.values() if f.dtype == dtype), None)
