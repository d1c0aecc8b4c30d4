"""What a run records: metrics.jsonl (and TensorBoard when installed), GPU power and energy through
NVML when nvidia-ml-py is installed, and the validation loss."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from .data import inputs_and_targets, step_loss


class Startup:
    """Seconds from this process's start (the command, for a one-process job; the kernel's clock, so
    the interpreter's own start and imports count) to the end of each phase before training, and of
    the first step: ``{"model": ..., "optimizer": ..., "first_step": ...}``; and, within the first
    step, how long making the optimizer's state took (``{"reserve": ..., "fill": ...}``: reserving its
    host memory, page-locking what crosses PCIe, then filling it) and the host's memory meanwhile
    (the memory free before, what the kernel did in each part). All in summary.json (``startup_s``,
    ``state_made_s``, ``state_made_memory``)."""

    def __init__(self):
        self.t0 = time.perf_counter() - _since_process_start()
        self.phases, self.state, self.memory = {}, None, None

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.perf_counter() - self.t0, 3)

    def summary(self) -> dict:
        return {"startup_s": dict(self.phases), **({"state_made_s": self.state} if self.state else {}),
                **({"state_made_memory": self.memory} if self.memory else {})}


def _since_process_start() -> float:
    """Seconds since this process started (/proc: its start and the uptime, in clock ticks); 0 where
    /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Power:
    """GPU power and energy through NVML (nvidia-ml-py), when available.

    NVML's energy counter advances in steps (on an H100 every 100 ms or so, by about 10 J), so a
    short training step usually sees no change and a later one the energy of several. Energy is
    therefore reported per window: a record carries ``energy_j`` only when the counter has moved, with
    the window it covers (``energy_window_s``, since the counter last moved) and that window's mean
    power; the run's total is the counter's difference from the start (``total_j``)."""

    def __init__(self, device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.first = self.last = pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self.last_t = time.perf_counter()
        except Exception:  # no nvidia-ml-py, no driver, or no energy counter on this GPU
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        try:
            now = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # mJ
            out = {"power_w": self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0}
        except Exception:
            return {}
        if now != self.last:
            t = time.perf_counter()
            window = t - self.last_t
            out["energy_j"] = (now - self.last) / 1000.0
            out["energy_window_s"] = window
            if window > 0:
                out["window_power_w"] = out["energy_j"] / window
            self.last, self.last_t = now, t
        return out

    def total_j(self) -> float:
        """The energy since this object was made (0.0 without NVML)."""
        if self.handle is None:
            return 0.0
        try:
            return (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self.first) / 1000.0
        except Exception:
            return 0.0


class Metrics:
    """metrics.jsonl, and TensorBoard when installed. A sink that fails (a full disk, a file system
    gone read-only) is reported once on stderr and dropped: training goes on, and its checkpoints say
    for themselves whether the disk still holds them."""

    def __init__(self, out: Path, resumed_at: int | None = None):
        self.path = out / "metrics.jsonl"
        self.file = None
        try:
            if resumed_at is not None:
                self._rewind(resumed_at)
            self.file = open(self.path, "a")
        except OSError as e:
            self._drop("file", e)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # TensorBoard not installed
            self.tb = None

    def _rewind(self, step: int) -> None:
        """A resumed run continues the file from its checkpoint: records of later steps (written
        before a kill, after the last save) go, so every step is in the file once; replaced
        atomically."""
        if not self.path.exists():
            return
        keep = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by the kill
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or rec["step"] <= step:
                    keep.append(json.dumps(rec) + "\n")
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)

    def _drop(self, which: str, e: BaseException) -> None:
        name = self.path if which == "file" else "TensorBoard"
        print(f"hytrain train: writing {name} failed ({type(e).__name__}: {e}); training goes on without it",
              file=sys.stderr, flush=True)
        sink = getattr(self, which)
        setattr(self, which, None)
        try:
            if sink is not None:
                sink.close()
        except Exception:  # closing flushes, which fails the same way
            pass

    def write(self, rec: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
            except OSError as e:
                self._drop("file", e)
        if self.tb is not None:
            try:
                self._tensorboard(rec)
            except Exception as e:  # its writer thread reports a failed disk at the next call
                self._drop("tb", e)

    def _tensorboard(self, rec: dict) -> None:
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
                elif isinstance(v, list) and k.endswith("_ranks"):  # one curve per rank
                    for r, x in enumerate(v):
                        if isinstance(x, (int, float)):
                            self.tb.add_scalar(f"{k[:-6]}/rank{r}", x, rec["step"])

    def close(self):
        for which in ("file", "tb"):
            sink = getattr(self, which)
            if sink is not None:
                try:
                    sink.close()
                except Exception as e:
                    self._drop(which, e)


def recorded(path: Path) -> list[dict]:
    """The step records of metrics.jsonl that carry a step and a loss (a line cut short, or none
    there, is left out); none where it is not a regular file (a device a failing sink was pointed at)."""
    rows = []
    try:
        if not path.is_file():
            return []
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "step" in rec and "loss" in rec:
                    rows.append(rec)
    except OSError:
        return []
    return rows


@torch.no_grad()
def evaluate(model, batches, device, ranks) -> float:
    """The validation loss over fixed global batches (each rank its rows of each)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for tokens, mask in batches:
            total += float(step_loss(model, *inputs_and_targets(tokens, mask, ranks, device)))
    model.train()
    return ranks.total(total, device) / ranks.world / len(batches)
