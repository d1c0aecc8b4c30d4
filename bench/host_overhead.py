"""Host overhead of HybridAdamW's Python side per step, on a model of many small blocks.

The update work of tiny parameters is negligible, so what a step costs here is the per-block and
per-parameter bookkeeping on the training thread: the gradient hooks, the hand-offs, the launches
and the waits. The model is a stack of `--blocks` small MLP layers (4 parameters each, `--width`
wide), fp32 on the CPU (the same Python path as CUDA parameters, less the copies), with
``release_grads=True`` (updates launched from the hooks during backward).

Modes, measured in one run on the same model and data:
  backward_only   backward + zero_grad, no optimizer (the floor the others are measured from)
  torch_adamw     torch.optim.AdamW(foreach=False): a named reference for per-parameter Python cost
  hybrid          HybridAdamW(model=..., release_grads=True)

Prints one JSON line per mode (median step time) and a line with each optimizer's overhead above
backward_only, per step and per parameter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import hytrain


class Stack(nn.Module):
    def __init__(self, blocks, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def run(mode, args):
    torch.manual_seed(0)
    model = Stack(args.blocks, args.width)
    x = torch.randn(args.batch, args.width)
    opt = None
    if mode == "torch_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    elif mode == "hybrid":
        opt = hytrain.HybridAdamW(model.parameters(), lr=1e-4, model=model, release_grads=True,
                                  workers=args.workers)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        model(x).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if opt is not None and hasattr(opt, "synchronize"):
        opt.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n_params = 4 * args.blocks
    out = {}
    for mode in ("backward_only", "torch_adamw", "hybrid"):
        out[mode] = run(mode, args)
        print(json.dumps({"mode": mode, "step_ms": round(out[mode] * 1e3, 3)}))
    floor = out["backward_only"]
    print(json.dumps({
        "blocks": args.blocks, "params": n_params,
        "hybrid_overhead_ms": round((out["hybrid"] - floor) * 1e3, 3),
        "hybrid_us_per_param": round((out["hybrid"] - floor) / n_params * 1e6, 2),
        "torch_adamw_overhead_ms": round((out["torch_adamw"] - floor) * 1e3, 3),
        "hybrid_vs_torch_overhead": round((out["hybrid"] - floor) / max(1e-9, out["torch_adamw"] - floor), 2),
    }))


if __name__ == "__main__":
    main()
