"""Run-time measurements for the k-split scheduler, taken on the compute stream without synchronising.

Each iteration :class:`Meter` records CUDA events on the compute stream: before and after each
forward hook's wait for updated weights (the difference is the time the stream stood waiting), when
each block's gradients are complete, around each GPU AdamW update, and at the step's launch. The
offload pipeline adds each block's D2H/H2D copy tickets and CPU update times. An iteration's events
are read one iteration later, when they have long completed, and turned into per-block costs for the
native ``KSplitScheduler``:

* forward of a hook's blocks: from the end of its wait to the start of the next hook's wait;
* backward of block j: from block j+1's gradients to block j's, less a GPU update run in between;
  the last block's forward + loss + backward is split 1:2 between forward and backward;
* D2H, CPU update and H2D: service times in the order the blocks were served (a block queued behind
  another is charged from the moment the resource freed up), so waiting is not counted as cost;
* step overhead: compute-stream time from the end of backward to the next forward, less the GPU
  updates run in it (clipping norm, launches, the training loop's own work).

It also yields what the user sees: the iteration's length on the compute stream and the share of it
the stream spent waiting for weights (``gpu_wait_frac``).
"""

from __future__ import annotations

import torch

from ._native import native


class _Record:
    __slots__ = ("index", "hooks", "bwd", "gpu", "passes", "launch", "deferred", "next_start",
                 "mem_peak", "resident")

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


def _service_times(spans):
    """(block, start, end) in arbitrary units -> {block: end - max(start, previous end)}, FIFO order."""
    out, free = {}, None
    for b, s, e in sorted(spans, key=lambda x: x[2]):
        begin = s if free is None else max(s, free)
        out[b] = max(0.0, e - begin)
        free = e
    return out


class _Discard:
    def observe(self, *args):
        pass

    def observe_overhead(self, *args):
        pass


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

        def ms(e):
            return ref.elapsed_time(e)

        P = native().Phase
        if scheduler is None:
            scheduler = _Discard()
        gpu_s = {b: s.elapsed_time(e) / 1e3 for b, (s, e) in rec.gpu.items()}
        for b, t in gpu_s.items():
            scheduler.observe(b, P.gpu, t)
        # Forward: hook i's blocks run from the end of its wait to the next hook's wait.
        wait_s = 0.0
        starts = [(blocks, ms(before), ms(after)) for blocks, before, after in rec.hooks]
        for i, (blocks, before, after) in enumerate(starts):
            wait_s += (after - before) / 1e3
            if i + 1 < len(starts) and blocks:
                scheduler.observe(blocks[0], P.forward, max(0.0, starts[i + 1][1] - after) / 1e3)
                for b in blocks[1:]:
                    scheduler.observe(b, P.forward, 0.0)
        bwd_ms = {b: ms(e) for b, e in rec.bwd.items()}
        last_hook_blocks, _, last_after = starts[-1]
        order = sorted(bwd_ms, key=lambda b: -b)  # backward order: last block first
        for i, b in enumerate(order):
            if i == 0:  # the last block: its forward, the loss and its backward together
                both = max(0.0, bwd_ms[b] - last_after) / 1e3
                if b in last_hook_blocks:
                    scheduler.observe(b, P.forward, both / 3)
                    both *= 2 / 3
                scheduler.observe(b, P.backward, both)
                continue
            prev = order[i - 1]
            t = (bwd_ms[b] - bwd_ms[prev]) / 1e3
            if not rec.deferred:
                t -= gpu_s.get(prev, 0.0)
            scheduler.observe(b, P.backward, max(0.0, t))
        # The pipeline's copies and CPU updates, as service times.
        d2h, h2d, cpu = [], [], []
        for b, info in rec.passes.items():
            for name, spans in (("d2h", d2h), ("h2d", h2d)):
                first, last = info[name]
                if first == 0:
                    continue
                try:
                    s, _ = self.pipeline.copy_times_ms(name, ref.cuda_event, first)
                    _, e = self.pipeline.copy_times_ms(name, ref.cuda_event, last)
                except RuntimeError:  # older than the copy stream's event ring
                    continue
                spans.append((b, s / 1e3, e / 1e3))
            _, start, end = info["update_ns"]
            if end > start:
                cpu.append((b, start / 1e9, end / 1e9))
        for phase, spans in ((P.d2h, d2h), (P.h2d, h2d), (P.cpu, cpu)):
            for b, t in _service_times(spans).items():
                scheduler.observe(b, phase, t)
        end_bwd = bwd_ms[min(bwd_ms)]
        next_ms = ms(rec.next_start)
        launch_ms = ms(rec.launch) if rec.launch is not None else end_bwd
        deferred_gpu = sum(gpu_s.values()) if rec.deferred else 0.0
        scheduler.observe_overhead(max(0.0, launch_ms - end_bwd) / 1e3,
                                   max(0.0, (next_ms - launch_ms) / 1e3 - deferred_gpu))
        span_s = next_ms / 1e3
        self.last = {"iter_gpu_s": span_s, "gpu_wait_s": wait_s,
                     "gpu_wait_frac": wait_s / span_s if span_s > 0 else 0.0,
                     "nonstate_peak_bytes": rec.mem_peak - (rec.resident or 0)}
        return self.last
