"""Iteration time of HybridAdamW on one GPU against torch.optim.AdamW on the same GPU, measured in one run.

Modes (same model, same data, bf16 weights, fp32 optimizer state):
  torch_gpu      torch.optim.AdamW(fused=True) with fp32 master weights on the GPU (the reference)
  no_overlap     HybridAdamW(overlap=False): every update inside step(), nothing overlapped
  hybrid_k0      HybridAdamW, every block updated by the CPU workers, overlapping backward/forward
  hybrid_k       HybridAdamW with --k leading blocks updated on the GPU

Prints one JSON line per mode (median iteration time after warm-up) and a summary line with ratios
against torch_gpu; writes a Chrome trace of the last hybrid_k iterations with --trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hytrain
from hytrain.models import LlamaConfig, LlamaModel


def make_model(args):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                      num_layers=args.layers, num_heads=args.hidden // 128, num_kv_heads=args.hidden // 128,
                      max_seq_len=args.seq)
    return LlamaModel(cfg).bfloat16().cuda()


class TorchMaster:
    """fp32 master weights on the GPU, fused torch AdamW, bf16 copy for compute."""

    def __init__(self, model, lr):
        self.params = list(model.parameters())
        self.master = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)

    def step(self):
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def run(mode, args):
    model = make_model(args)
    if mode == "torch_gpu":
        opt = TorchMaster(model, 1e-4)
    else:
        opt = hytrain.HybridAdamW(model.parameters(), lr=1e-4, model=model,
                                  gpu_blocks=args.k if mode == "hybrid_k" else 0,
                                  overlap=mode != "no_overlap", trace=args.trace is not None and mode == "hybrid_k",
                                  release_grads=True)  # no clipping: updates start during backward
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=g)
    times = []
    torch.cuda.synchronize()
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # The compute stream only: the copy streams (CPU updates) may still run; the next
        # forward's waits for them fall in the next iteration.
        torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t0)
    if isinstance(opt, hytrain.HybridAdamW):
        opt.synchronize()
        if opt.timeline is not None:
            opt.export_trace(args.trace)
    torch.cuda.synchronize()
    it = statistics.median(times[args.warmup:])
    n = sum(p.numel() for p in model.parameters())
    rec = {"mode": mode, "params": n, "iter_s": it, "tokens_per_s": args.batch * args.seq / it,
           "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9}
    del opt, model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    print(json.dumps(rec), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--trace", default=None, help="write a Chrome trace of the hybrid_k run here")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and hytrain.cuda_available()):
        raise SystemExit("hybrid_step.py needs a CUDA GPU and hytrain built with CUDA")
    recs = {m: run(m, args) for m in ("torch_gpu", "no_overlap", "hybrid_k0", "hybrid_k")}
    ref = recs["torch_gpu"]["iter_s"]
    print(json.dumps({"summary": True, "device": torch.cuda.get_device_name(),
                      **{f"{m}_vs_torch_gpu": recs[m]["iter_s"] / ref for m in recs if m != "torch_gpu"},
                      "overlap_speedup": recs["no_overlap"]["iter_s"] / recs["hybrid_k0"]["iter_s"]}))


if __name__ == "__main__":
    main()
