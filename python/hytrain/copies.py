"""Copy streams: host<->device copies on native CUDA streams, with host completion notification.

A :class:`CopyStream` carries one direction (``"d2h"`` or ``"h2d"``) on its own CUDA stream, separate
from PyTorch's compute stream. Each copy returns a ticket (1, 2, 3, ...); tickets land in order, the
host learns of each one through a host function (``query``, ``wait``, ``completed``), and another stream
can wait for a ticket on the device (``make_wait``) without synchronising the host. Host buffers must be
page-locked (a :class:`hytrain.PinnedPool` or ``pin_memory()``), so every copy is truly asynchronous.

The stream keeps references to both tensors of a copy until the host has seen it land, so dropping
them early never frees memory that a copy is still reading or writing.
"""

from __future__ import annotations

import collections

import torch

from . import _checks
from ._native import native

DIRECTIONS = ("d2h", "h2d")


class CopyStream:
    """One direction of host<->device traffic on its own stream.

    Args:
        direction: ``"d2h"`` (device to host) or ``"h2d"`` (host to device).
        device: the CUDA device (default: the current one).
        priority: CUDA stream priority; negative is higher, clamped to the device's range.
    """

    def __init__(self, direction: str, device=None, *, priority: int = 0):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
        if not native().cuda_available():
            raise RuntimeError("CopyStream needs hytrain built with CUDA and a usable GPU")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.direction = direction
        self.device = device
        self._native = native().CudaCopyStream(device.index, direction,
                                               _checks.integer("priority", priority))
        self._held = collections.deque()  # (ticket, dst, src) until the host has seen it land

    @property
    def stream(self) -> torch.cuda.ExternalStream:
        """The stream as a torch stream object (for ``torch.cuda.stream(...)`` or ``wait_stream``)."""
        return torch.cuda.ExternalStream(self._native.handle, device=self.device)

    @property
    def issued(self) -> int:
        return int(self._native.issued)

    @property
    def completed(self) -> int:
        return int(self._native.completed)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, after: torch.cuda.Stream | None = None) -> int:
        """Enqueues ``dst.copy_(src)`` (same dtype and size, both contiguous); returns its ticket.

        With ``after``, the copy first waits on the device for the work already enqueued on that stream
        (the compute stream that produced ``src``, or last read ``dst``).
        """
        dev_name, host_name = ("src", "dst") if self.direction == "d2h" else ("dst", "src")
        dev, host = (src, dst) if self.direction == "d2h" else (dst, src)
        for name, t in ((dev_name, dev), (host_name, host)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if src.dtype != dst.dtype:
            raise TypeError(f"dst has dtype {dst.dtype} but src has {src.dtype}; a copy stream does not convert")
        _checks.tensor(dev_name, dev, dtypes=(dev.dtype,), device="cuda")
        _checks.tensor(host_name, host, dtypes=(host.dtype,), numel=dev.numel(), device="cpu")
        if dev.device != self.device:
            raise ValueError(f"{dev_name} is on {dev.device} but this copy stream is on {self.device}")
        if host.numel() > 0 and not native().is_page_locked(host.data_ptr()):
            raise ValueError(f"{host_name} is pageable host memory; copy streams need page-locked memory "
                             "(allocate it from hytrain.PinnedPool or call .pin_memory())")
        after_handle = None  # note: torch's default stream has handle 0, a valid stream
        if after is not None:
            if after.device != self.device:
                raise ValueError(f"after is a stream on {after.device} but this copy stream is on {self.device}")
            after_handle = after.cuda_stream
        ticket = self._native.copy(_checks.address(dst), _checks.address(src),
                                   dev.numel() * dev.element_size(), after_handle)
        self._held.append((ticket, dst, src))
        self._release_landed()
        return int(ticket)

    def make_wait(self, stream: torch.cuda.Stream, ticket: int | None = None) -> None:
        """Makes ``stream`` wait on the device until ``ticket`` (default: the last copy) has landed."""
        if stream.device != self.device:
            raise ValueError(f"stream is on {stream.device} but this copy stream is on {self.device}")
        self._native.make_wait(stream.cuda_stream, self._ticket(ticket))

    def query(self, ticket: int | None = None) -> bool:
        """True when ``ticket`` (default: the last copy) has landed."""
        done = bool(self._native.query(self._ticket(ticket)))
        self._release_landed()
        return done

    def wait(self, ticket: int | None = None, timeout: float | None = None) -> None:
        """Blocks until ``ticket`` (default: the last copy) has landed.

        Raises TimeoutError after ``timeout`` seconds, RuntimeError on a CUDA error in the stream.
        """
        t = -1.0 if timeout is None else _checks.real("timeout", timeout, lo=0.0)
        self._native.wait(self._ticket(ticket), t)
        self._release_landed()

    def times_ms(self, ticket: int) -> tuple[float, float]:
        """(start, end) of a landed copy in ms since the stream was created (recent tickets only)."""
        return tuple(self._native.times_ms(self._ticket(ticket)))

    def _ticket(self, ticket: int | None) -> int:
        if ticket is None:
            return self.issued
        ticket = _checks.integer("ticket", ticket, lo=0)
        if ticket > self.issued:
            raise ValueError(f"ticket {ticket} was never issued (last is {self.issued})")
        return ticket

    def _release_landed(self) -> None:
        done = self.completed
        while self._held and self._held[0][0] <= done:
            self._held.popleft()

    def __del__(self):
        # The native stream drains its queue on destruction; the held tensors outlive that.
        nat = getattr(self, "_native", None)
        if nat is not None:
            del self._native
