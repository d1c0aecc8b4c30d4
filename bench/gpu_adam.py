"""hytrain's fused multi-tensor CUDA AdamW against torch.optim.AdamW(fused=True) plus the separate
bf16 cast of the weights torch needs, over about 1 B parameters in a list of many small and a few
huge tensors, beside the device copy bandwidth measured in the same run.

Bytes per parameter (each read once, each write once):
  hytrain mixed : p, m, v read+write (24) + bf16 grad (2) + bf16 weight write (2)  = 28
  hytrain fp32g : p, m, v read+write (24) + fp32 grad (4) + bf16 weight write (2)  = 30
  torch         : fused AdamW on fp32 grads (28) + cast fp32 -> bf16 weights (6)   = 34
Floor: bytes / (device copy bandwidth, read + write counted).

Ends with one JSON line: vs_torch_plus_cast (torch's time / hytrain mixed), vs_torch_same_inputs
(torch / hytrain with fp32 gradients), bandwidth_fraction (hytrain mixed GB/s / copy GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import hytrain


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the ~1 B parameters")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    s = args.scale
    sizes = [int(100e6 * s)] * 8 + [int(100e3 * s) + 3] * 1000 + [4099] * 200
    n = sum(sizes)
    dev = torch.device("cuda")

    # Device copy bandwidth (read + write) over 2 GB.
    src = torch.randn(int(512e6 * min(s, 1.0)) + 1, device=dev)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 4 / time_ms(lambda: dst.copy_(src), args.iters) / 1e6
    del src, dst

    def randn(k, dtype=torch.float32):
        return torch.randn(k, device=dev).to(dtype)

    # torch: fp32 params with fp32 grads, fused AdamW, then the bf16 cast of every weight.
    tparams = [torch.nn.Parameter(randn(k)) for k in sizes]
    for p in tparams:
        p.grad = randn(p.numel()) * 1e-3
    topt = torch.optim.AdamW(tparams, lr=1e-4, weight_decay=0.01, fused=True)
    tw16 = [torch.empty(k, dtype=torch.bfloat16, device=dev) for k in sizes]

    def torch_step():
        topt.step()
        torch._foreach_copy_(tw16, [p.detach() for p in tparams])

    t_torch = time_ms(torch_step, args.iters)
    tgrads32 = [p.grad for p in tparams]
    del topt
    for p in tparams:
        p.grad = None

    ps = [randn(k) for k in sizes]
    ms = [torch.zeros(k, device=dev) for k in sizes]
    vs = [torch.zeros(k, device=dev) for k in sizes]
    g16 = [g.to(torch.bfloat16) for g in tgrads32]
    w16 = [torch.empty(k, dtype=torch.bfloat16, device=dev) for k in sizes]
    mixed = hytrain.CudaAdamW(ps, ms, vs, g16, weights=w16)
    fp32g = hytrain.CudaAdamW(ps, ms, vs, tgrads32, weights=w16)
    state = {"step": 0}

    def ours(group):
        state["step"] += 1
        group.step(step=state["step"], lr=1e-4, weight_decay=0.01)

    t_mixed = time_ms(lambda: ours(mixed), args.iters)
    t_fp32g = time_ms(lambda: ours(fp32g), args.iters)

    name = torch.cuda.get_device_name()
    print(f"fused AdamW, {n / 1e9:.3f} B params in {len(sizes)} tensors, {name}")
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'':28s} {'ms':>8s} {'B/param':>8s} {'GB/s':>7s} {'vs copy':>8s}")
    for label, t, bpp in [("torch fused + bf16 cast", t_torch, 34), ("hytrain, bf16 grads", t_mixed, 28),
                          ("hytrain, fp32 grads", t_fp32g, 30)]:
        gbps = bpp * n / t / 1e6
        print(f"{label:28s} {t:8.2f} {bpp:8d} {gbps:7.0f} {gbps / copy_gbps:8.2f}")
    print(json.dumps({
        "bench": "gpu_adam", "device": name, "params": n,
        "vs_torch_plus_cast": round(t_torch / t_mixed, 3),
        "vs_torch_same_inputs": round(t_torch / t_fp32g, 3),
        "bandwidth_fraction": round(28 * n / t_mixed / 1e6 / copy_gbps, 3),
        "copy_gbps": round(copy_gbps, 1),
    }))


if __name__ == "__main__":
    main()
