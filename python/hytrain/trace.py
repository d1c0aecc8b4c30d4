"""Timelines of training iterations, written as Chrome-trace JSON (opens in Perfetto or chrome://tracing).

:class:`Timeline` collects, per iteration, marks on the compute stream (each block's forward start and
the moment its gradients are complete), the fused GPU updates, each block's pass through the offload
pipeline (D2H copy tickets, CPU update times, H2D copy tickets) and k. On a GPU the marks are CUDA
events; nothing is read back until :meth:`Timeline.export`, so recording costs a few event records
per block and no synchronisation. On the CPU the marks are host clock readings.

Times are placed on one host-clock axis: at export, an event recorded on an idle device is matched
with the host clock (``steady_now_ns``), and every CUDA event and copy is placed by its elapsed time
from the iteration's first event.
"""

from __future__ import annotations

import collections
import json
import os

import torch

from ._native import native


class _Iteration:
    def __init__(self, index: int):
        self.index = index
        self.epoch = None            # first CUDA event of the iteration (GPU only)
        self.marks = []              # (kind, block, time): host ns (CPU) or torch.cuda.Event (GPU)
        self.gpu_updates = []        # (block, start, end) events
        self.passes = {}             # block -> pipeline last_pass dict (GPU) or (submit, start, end) ns
        self.k = 0


class Timeline:
    """Records the last ``keep`` iterations. ``device``: the CUDA device, or None for the CPU path."""

    def __init__(self, device: torch.device | None = None, keep: int = 3):
        self.device = device
        self.iterations = collections.deque(maxlen=keep)
        self._current = None
        self._index = 0
        self.pipeline = None  # the native OffloadPipeline, for copy times

    @property
    def current(self) -> _Iteration:
        if self._current is None:
            self._current = _Iteration(self._index)
            self.iterations.append(self._current)
        return self._current

    def next_iteration(self) -> None:
        self._current = None
        self._index += 1

    def _now(self):
        if self.device is None:
            return native().steady_now_ns()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def mark(self, kind: str, block: int) -> None:
        """``kind``: "forward" (block's forward starts) or "backward" (block's gradients complete)."""
        it = self.current
        t = self._now()
        if it.epoch is None and self.device is not None:
            it.epoch = t
        it.marks.append((kind, block, t))

    def gpu_update(self, block: int, start, end) -> None:
        it = self.current
        if it.epoch is None:
            it.epoch = start
        it.gpu_updates.append((block, start, end))

    # ---- export -----------------------------------------------------------------------------------

    def _resolver(self):
        """A function mapping a mark/event to host ns, and one mapping (direction, ticket, epoch)."""
        if self.device is None:
            return (lambda it, t: t), None
        torch.cuda.synchronize(self.device)
        now = torch.cuda.Event(enable_timing=True)
        now.record(torch.cuda.current_stream(self.device))
        now.synchronize()
        t_now = native().steady_now_ns()

        def event_ns(it, e):
            return t_now - (it.epoch.elapsed_time(now) - it.epoch.elapsed_time(e)) * 1e6

        def copy_ns(it, direction, ticket):
            a, b = self.pipeline.copy_times_ms(direction, it.epoch.cuda_event, ticket)
            off = it.epoch.elapsed_time(now)
            return t_now - (off - a) * 1e6, t_now - (off - b) * 1e6

        return event_ns, copy_ns

    def events(self) -> list[dict]:
        """Chrome-trace events (``ph`` X, C and M) for the recorded iterations."""
        event_ns, copy_ns = self._resolver()
        gpu = self.device is not None
        pid_dev, pid_cpu = 1, 2
        tids = {"compute": 1, "gpu_adam": 2, "d2h": 3, "h2d": 4}
        out = [
            {"ph": "M", "name": "process_name", "pid": pid_dev,
             "args": {"name": f"GPU {self.device}" if gpu else "compute (CPU)"}},
            {"ph": "M", "name": "process_name", "pid": pid_cpu, "args": {"name": "CPU AdamW workers"}},
        ]
        for name, tid in tids.items():
            label = {"compute": "compute stream", "gpu_adam": "GPU AdamW (compute stream)",
                     "d2h": "D2H copy stream", "h2d": "H2D copy stream"}[name]
            out.append({"ph": "M", "name": "thread_name", "pid": pid_dev, "tid": tid, "args": {"name": label}})
        spans = []  # (pid, tid, name, start_ns, end_ns, args)
        updates = []
        for it in self.iterations:
            if gpu and it.epoch is None:
                continue
            marks = sorted(((event_ns(it, t), kind, b) for kind, b, t in it.marks), key=lambda m: m[0])
            for (t1, k1, b1), (t2, k2, b2) in zip(marks, marks[1:]):
                if k2 == "backward":
                    spans.append((pid_dev, tids["compute"], f"backward block {b2}", t1, t2, {"iteration": it.index}))
                elif k1 == "forward":
                    spans.append((pid_dev, tids["compute"], f"forward block {b1}", t1, t2, {"iteration": it.index}))
            for b, s, e in it.gpu_updates:
                spans.append((pid_dev, tids["gpu_adam"], f"AdamW block {b}", event_ns(it, s), event_ns(it, e),
                              {"iteration": it.index}))
            for b, info in sorted(it.passes.items()):
                if isinstance(info, dict):
                    for d in ("d2h", "h2d"):
                        first, last = info[d]
                        if first == 0:
                            continue
                        try:
                            s, _ = copy_ns(it, d, first)
                            _, e = copy_ns(it, d, last)
                        except RuntimeError:  # older than the copy stream's event ring
                            continue
                        spans.append((pid_dev, tids[d], f"{d} block {b}", s, e,
                                      {"iteration": it.index, "bytes": info[f"{d}_bytes"]}))
                    submit, start, end = info["update_ns"]
                    team = {"workers": info.get("update_workers"), "busy_ms": info.get("update_busy_ns", 0) / 1e6}
                else:  # UpdateEngine timing: (submit, start, end, elements, busy_ns, workers)
                    submit, start, end = info[0], info[1], info[2]
                    team = {"workers": info[5], "busy_ms": info[4] / 1e6}
                if end > start:
                    updates.append((start, end, b, it.index, max(0, start - submit) if submit else 0, team))
            if marks:
                out.append({"ph": "C", "name": "k (GPU-updated blocks)", "pid": pid_dev,
                            "ts": marks[0][0], "args": {"k": it.k}})
        # CPU updates: one lane per concurrently running block (blocks are shared by all workers).
        lanes = []
        for start, end, b, idx, queued, team in sorted(updates, key=lambda u: u[:5]):
            lane = next((i for i, free_at in enumerate(lanes) if free_at <= start), None)
            if lane is None:
                lanes.append(end)
                lane = len(lanes) - 1
            lanes[lane] = end
            spans.append((pid_cpu, 10 + lane, f"AdamW block {b}", start, end,
                          {"iteration": idx, "queued_us": queued / 1e3, **team}))
        for lane in range(len(lanes)):
            out.append({"ph": "M", "name": "thread_name", "pid": pid_cpu, "tid": 10 + lane,
                        "args": {"name": f"block updates (lane {lane})"}})
        if not spans:
            return out
        t0 = min(s[3] for s in spans)
        for pid, tid, name, s, e, args in spans:
            out.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": (s - t0) / 1e3,
                        "dur": max(0.0, (e - s) / 1e3), "args": args})
        for ev in out:
            if ev["ph"] == "C":
                ev["ts"] = (ev["ts"] - t0) / 1e3
        return out

    def export(self, path: str | os.PathLike) -> str:
        """Writes the recorded iterations as Chrome-trace JSON; returns the path."""
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)
        return path
