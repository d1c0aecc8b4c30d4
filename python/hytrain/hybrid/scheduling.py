"""The k-split scheduler's glue: block sizes, the GPU memory budget, a start-up probe of the GPU
AdamW's rate, and after each step the measured iteration fed to the native ``KSplitScheduler`` and its
decision applied (k, and where speculation starts)."""

from __future__ import annotations

import torch

from .._native import native
from ..cuda_adam import CudaAdamW
from . import distributed
from .common import local


class Scheduling:

    def _block_sizes(self):
        numel, weight, state = [], [], []
        for blk in self._blocks:
            n = w = s = 0
            for p in blk:
                e = local(p).numel()
                n += e
                w += e * p.element_size()
                per = 8 + (4 if self._group_of[id(p)]["amsgrad"] else 0) + p.element_size()
                if p.dtype != torch.float32:
                    per += 4  # master
                s += e * per
            numel.append(max(1, n))
            weight.append(w)
            state.append(s)
        return numel, weight, state

    def _start_scheduler(self, limit):
        numel, weight, self._state_bytes = self._block_sizes()
        self._scheduler = native().KSplitScheduler(numel, weight, self._state_bytes,
                                                   every=self.schedule_every, deferred=True)
        if limit is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = 1.0
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            if getter is not None:
                try:
                    fraction = float(getter(self.device))
                except (RuntimeError, TypeError):
                    fraction = 1.0
            limit = int(total * fraction)
        self.gpu_memory_limit = limit
        self._nonstate_peak = 0
        self._scheduler.memory_budget = 0.0  # nothing resident until a step's peak has been seen
        self._probe_gpu_rate()

    def _probe_gpu_rate(self):
        """alpha's GPU side before any block runs there: the fused AdamW on 4 M scratch elements."""
        n = 1 << 22
        dtype = self._blocks[0][0].dtype
        t = [torch.zeros(n, device=self.device) for _ in range(3)]
        g = torch.full((n,), 1e-3, dtype=dtype, device=self.device)
        w = torch.empty(n, dtype=dtype, device=self.device) if dtype != torch.float32 else None
        fused = CudaAdamW([t[0]], [t[1]], [t[2]], [g], weights=[w] if w is not None else None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fused.step(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        start.record()
        for i in range(3):
            fused.step(step=2 + i, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        end.record()
        end.synchronize()
        self._scheduler.observe_rate(native().Phase.gpu, start.elapsed_time(end) / 1e3 / 3 / n)

    def _schedule(self, record):
        """After a step's launches: feed the last complete iteration's costs, refresh the memory
        budget, and let the scheduler pick k for the next step (migrations start now)."""
        summary = self._meter.harvest(record, self._scheduler) if record is not None else None
        if summary is not None:
            self._last_summary = {k: v for k, v in summary.items() if k != "nonstate_peak_bytes"}
        if self._scheduler is None:
            return
        self._scheduler.deferred = True  # updates are applied in step(), never during backward
        self._scheduler.overlap = self.overlap
        self._scheduler.early_copies = self._early_handoff()
        self._scheduler.speculative_min = self._speculation_floor()
        self._scheduler.speculative_fixed = self.speculate != "auto"  # predictions as the run does
        if not self.auto:
            if self._scheduler.ready():
                self._prediction = self._scheduler.predict(self.gpu_blocks)
                self._speculate_as_predicted()
            return
        k = self.gpu_blocks
        if summary is not None:
            # The most memory seen in use apart from resident states, sampled as each block's
            # gradients completed (backward is where activations and gradients meet), plus a margin
            # for what falls between samples (the loss, temporary buffers).
            self._nonstate_peak = max(self._nonstate_peak, summary["nonstate_peak_bytes"])
            margin = (1 << 30) + self.gpu_memory_limit // 20
            self._scheduler.memory_budget = float(max(0, self.gpu_memory_limit - self._nonstate_peak - margin))
            k = self._scheduler.decide(self.gpu_blocks)
        if self._agree_group is not None:
            # Sharded: each rank decides from its own measurements, and all take the smallest k --
            # within every rank's memory budget, and every rank's migration falls in the same step
            # (a step is as slow as its slowest rank). Every rank takes part every step, decision or
            # not (a rank whose iteration was not measured offers its current k).
            k = distributed.agree_min(k, self._agree_group)
        if k != self.gpu_blocks:
            self._migrate(k)
        if summary is not None and self._scheduler.ready():
            self._prediction = self._scheduler.last_prediction()
            self._speculate_as_predicted()

    def _speculate_as_predicted(self):
        if self.speculate == "auto":
            self._speculate_from(self._prediction["speculative_from"])
