"""What a run records: metrics.jsonl (and TensorBoard when installed), GPU power and energy through
NVML when nvidia-ml-py is installed, and the validation loss."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .data import batch_at


class Power:
    """GPU power and energy through NVML (nvidia-ml-py), when available."""

    def __init__(self, device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.last = pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # no nvidia-ml-py, no driver, or no energy counter on this GPU
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        try:
            now = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            out = {"power_w": self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                   "energy_j": (now - self.last) / 1000.0}
            self.last = now
            return out
        except Exception:
            return {}


class Metrics:
    def __init__(self, out: Path):
        self.file = open(out / "metrics.jsonl", "a")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # TensorBoard not installed
            self.tb = None

    def write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


@torch.no_grad()
def evaluate(model, val, args, device) -> float:
    model.eval()
    total = 0.0
    for i in range(args.eval_batches):
        b = batch_at(val, i, args.batch_size, args.seq_len, seed=12345).to(device)
        total += float(model(b[:, :-1], b[:, 1:]))
    model.train()
    return total / args.eval_batches
