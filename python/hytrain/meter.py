"""Run-time measurements for the k-split scheduler, taken on the compute stream without synchronising.

Each iteration :class:`Meter` records CUDA events on the compute stream: before and after each
forward hook's wait for updated weights (the difference is the time the stream stood waiting), when
each block's gradients are complete, around each GPU AdamW update, and at the step's launch. The
offload pipeline adds each block's D2H/H2D copy tickets and CPU update times. An iteration's events
are read one iteration later, when they have long completed, turned into plain times
(``IterationTimes``), and charged to per-block phases by the native ``attribute_iteration``, which
lives beside the simulation that replays those phases (``core/ksplit.cpp``): the cost model is
measured and simulated on one side of the seam.

It also yields what the user sees: the iteration's length on the compute stream and the share of it
the stream spent waiting for weights (``gpu_wait_frac``).
"""

from __future__ import annotations

import torch

from ._native import native


class _Record:
    __slots__ = ("index", "hooks", "bwd", "gpu", "passes", "launch", "deferred", "next_start",
                 "mem_peak", "resident", "last_forward", "fragmented", "alloc_retries")

    def __init__(self, index: int, deferred: bool):
        self.index = index
        self.hooks = []      # (blocks, event before the wait, event after it)
        self.bwd = {}        # block -> event when its gradients were complete
        self.gpu = {}        # block -> (start, end) events of its GPU AdamW update
        self.passes = {}     # block -> OffloadPipeline.last_pass dict
        self.launch = None   # event at the step's launch (deferred mode)
        self.deferred = deferred
        self.next_start = None  # the next iteration's first pre-wait event
        self.mem_peak = 0       # the most GPU memory allocated when a block's gradients were complete
        self.resident = None    # bytes of resident optimizer states during backward
        self.last_forward = None  # accumulation: the last hook of the step's last micro-batch forward
        self.fragmented = 0     # the caching allocator's reserve that cannot be released (split blocks)
        self.alloc_retries = 0  # times the allocator freed its cache to retry a cudaMalloc, since the last step


class Meter:
    WARMUP = 2  # iterations not measured: allocator growth, kernel selection, first copies

    def __init__(self, device: torch.device, pipeline, n_blocks: int, first_index: int = 0):
        self.device = device
        self.pipeline = pipeline
        self.n_blocks = n_blocks
        self.current = None
        self.started = first_index  # the index the next recorded iteration gets
        self.pending = None   # the finished iteration, read at the next step
        self.last = {}        # what the last harvest measured (seconds and shares)
        self._retries = None  # the allocator's retry count at the last step's launch

    def _event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def start(self, deferred: bool) -> None:
        if self.current is None:
            self.current = _Record(self.started, deferred)
            self.started += 1

    def before_wait(self):
        return self._event()

    def after_wait(self, blocks, before) -> None:
        if self.current is not None and torch.is_grad_enabled():
            if not self.current.hooks and self.pending is not None and self.pending.next_start is None:
                self.pending.next_start = before
            self.current.hooks.append((list(blocks), before, self._event()))

    def later_forward(self) -> None:
        """A forward hook of a later micro-batch (accumulation): where the last one ends is where the
        step's last backward begins."""
        if self.current is not None and self.current.hooks:
            self.current.last_forward = self._event()

    def backward_done(self, block: int, resident=None) -> None:
        if self.current is not None:
            self.current.bwd[block] = self._event()
            self.current.mem_peak = max(self.current.mem_peak, torch.cuda.memory_allocated(self.device))
            if self.current.resident is None and resident is not None:
                self.current.resident = resident()

    def gpu_update(self, block: int, start, end) -> None:
        if self.current is not None:
            self.current.gpu[block] = (start, end)

    def launched(self) -> None:
        if self.current is not None:
            self.current.launch = self._event()
            # Once per step (the call builds a dict): what the allocator reserves beyond what is
            # allocated and could not give back -- free pieces of segments still in use. Wholly free
            # cached segments it releases itself before failing an allocation.
            stats = torch.cuda.memory_stats(self.device)
            self.current.fragmented = int(stats.get("inactive_split_bytes.all.current", 0))
            # And how often, since the last step, an allocation found the memory limit reached and the
            # allocator freed its cache and retried: each time it synchronises the device.
            retries = int(stats.get("num_alloc_retries", 0))
            self.current.alloc_retries = retries - self._retries if self._retries is not None else 0
            self._retries = retries

    def add_pass(self, block: int, info: dict) -> None:
        if self.current is not None:
            self.current.passes[block] = info

    def end_iteration(self):
        """Closes the iteration; returns the previous one for harvesting (its next_start is known)."""
        done, self.pending, self.current = self.pending, self.current, None
        return done

    def harvest(self, rec: _Record, scheduler=None) -> dict | None:
        """Feeds one finished iteration's costs to ``scheduler`` (when given); returns the measured
        summary, or None while the iteration is incomplete."""
        if (rec is None or rec.index < self.WARMUP or not rec.hooks or rec.next_start is None
                or len(rec.bwd) < self.n_blocks):
            return None
        rec.next_start.synchronize()  # recorded an iteration ago: complete, this returns at once
        ref = rec.hooks[0][1]
        # Accumulation: the micro-batches before the last add the same time to every k (the updates
        # need the last one's gradients). The iteration is measured as one micro-batch: the first
        # forward (where the updated weights are waited for) followed by the last backward, shifted
        # back by the time between the two forwards' last hooks.
        shift = rec.hooks[-1][2].elapsed_time(rec.last_forward) if rec.last_forward is not None else 0.0
        n = native()
        t = n.IterationTimes()
        t.waits = [n.ForwardWait(list(blocks), ref.elapsed_time(before), ref.elapsed_time(after))
                   for blocks, before, after in rec.hooks]
        t.backward_ms = [(b, ref.elapsed_time(e) - shift) for b, e in rec.bwd.items()]
        t.gpu_update_s = [(b, s.elapsed_time(e) / 1e3) for b, (s, e) in rec.gpu.items()]
        spans = {"d2h": [], "h2d": [], "cpu": []}
        for b, info in rec.passes.items():
            for name in ("d2h", "h2d"):
                first, last = info[name]
                if first == 0:
                    continue
                try:
                    start, _ = self.pipeline.copy_times_ms(name, ref.cuda_event, first)
                    _, end = self.pipeline.copy_times_ms(name, ref.cuda_event, last)
                except RuntimeError:  # older than the copy stream's event ring
                    continue
                spans[name].append(n.BlockSpan(b, start / 1e3, end / 1e3))
            _, start, end = info["update_ns"]
            if end > start:
                spans["cpu"].append(n.BlockSpan(b, start / 1e9, end / 1e9))
        t.d2h, t.h2d, t.cpu = spans["d2h"], spans["h2d"], spans["cpu"]
        if rec.launch is not None:
            t.launch_ms = ref.elapsed_time(rec.launch) - shift
        t.next_start_ms = ref.elapsed_time(rec.next_start) - shift
        t.deferred = rec.deferred
        self.last = dict(n.attribute_iteration(t, scheduler))
        self.last["nonstate_peak_bytes"] = rec.mem_peak - (rec.resident or 0) + rec.fragmented
        self.last["alloc_retries"] = rec.alloc_retries
        return self.last
