"""Host<->device copies through hytrain's copy streams and pinned pool, against torch's own pinned
copies (``pin_memory()`` tensors, ``copy_(non_blocking=True)`` on a side stream) in the same run.

Floor: one PCIe (or C2C) link direction. Each copy moves its bytes once; a link is full duplex, so
H2D and D2H at once can approach twice the one-way rate (bidir_vs_one_way -> 2).

For each size (64 MB to 1 GB) every mode moves `--repeats` copies back to back and is timed from the
first issue to the host seeing the last land (median of `--trials`). Ends with one JSON line:
h2d_vs_torch and d2h_vs_torch (hytrain GB/s over torch GB/s, the smallest over sizes) and
bidir_vs_one_way (hytrain's both-ways GB/s over the mean of its one-way rates, the smallest over sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hytrain

MB = 1 << 20


def timed(run, trials: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    if not (hytrain.cuda_available() and torch.cuda.is_available()):
        raise SystemExit("bench/copies.py needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(dev)}")
    biggest = max(args.sizes_mb) * MB
    pool = hytrain.PinnedPool(4 * biggest + 64 * MB, slab_bytes=biggest)
    h2d, d2h = hytrain.CopyStream("h2d", dev), hytrain.CopyStream("d2h", dev)
    side_a, side_b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    rows = []
    for size_mb in args.sizes_mb:
        n = size_mb * MB
        ours_up, ours_down = pool.empty(n, torch.uint8), pool.empty(n, torch.uint8)
        ours_up.fill_(1)
        theirs_up, theirs_down = torch.ones(n, dtype=torch.uint8).pin_memory(), torch.empty(
            n, dtype=torch.uint8).pin_memory()
        dev_in, dev_out = torch.empty(n, dtype=torch.uint8, device=dev), torch.full(
            (n,), 2, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        r = args.repeats

        def ours(up: bool, down: bool):
            for _ in range(r):
                if up:
                    h2d.copy_(dev_in, ours_up)
                if down:
                    d2h.copy_(ours_down, dev_out)
            if up:
                h2d.wait()
            if down:
                d2h.wait()

        def theirs(up: bool, down: bool):
            for _ in range(r):
                if up:
                    with torch.cuda.stream(side_a):
                        dev_in.copy_(theirs_up, non_blocking=True)
                if down:
                    with torch.cuda.stream(side_b):
                        theirs_down.copy_(dev_out, non_blocking=True)
            side_a.synchronize()
            side_b.synchronize()

        gbps = {}
        for name, fn in (("ours", ours), ("torch", theirs)):
            for mode, up, down in (("h2d", True, False), ("d2h", False, True), ("bidir", True, True)):
                moved = r * n * (int(up) + int(down))
                gbps[f"{name}_{mode}"] = moved / timed(lambda: fn(up, down), args.trials) / 1e9
        assert torch.equal(ours_down[:4096].cpu(), dev_out[:4096].cpu())
        assert torch.equal(dev_in[:4096].cpu(), ours_up[:4096])
        one_way = (gbps["ours_h2d"] + gbps["ours_d2h"]) / 2
        row = {"size_mb": size_mb, **{k: round(v, 2) for k, v in gbps.items()},
               "h2d_vs_torch": gbps["ours_h2d"] / gbps["torch_h2d"],
               "d2h_vs_torch": gbps["ours_d2h"] / gbps["torch_d2h"],
               "bidir_vs_one_way": gbps["ours_bidir"] / one_way,
               "torch_bidir_vs_one_way": gbps["torch_bidir"] / ((gbps["torch_h2d"] + gbps["torch_d2h"]) / 2)}
        rows.append(row)
        print(f"{size_mb:5d} MB  GB/s ours h2d {gbps['ours_h2d']:6.1f} d2h {gbps['ours_d2h']:6.1f} "
              f"both {gbps['ours_bidir']:6.1f} | torch h2d {gbps['torch_h2d']:6.1f} d2h "
              f"{gbps['torch_d2h']:6.1f} both {gbps['torch_bidir']:6.1f} | h2d x{row['h2d_vs_torch']:.3f} "
              f"d2h x{row['d2h_vs_torch']:.3f} bidir/one-way {row['bidir_vs_one_way']:.2f}", flush=True)
        del ours_up, ours_down, theirs_up, theirs_down, dev_in, dev_out

    summary = {
        "bench": "copies",
        "device": torch.cuda.get_device_name(dev),
        "h2d_vs_torch": round(min(r["h2d_vs_torch"] for r in rows), 3),
        "d2h_vs_torch": round(min(r["d2h_vs_torch"] for r in rows), 3),
        "bidir_vs_one_way": round(min(r["bidir_vs_one_way"] for r in rows), 3),
        "torch_bidir_vs_one_way": round(min(r["torch_bidir_vs_one_way"] for r in rows), 3),
        "peak_h2d_gbps": max(r["ours_h2d"] for r in rows),
        "peak_d2h_gbps": max(r["ours_d2h"] for r in rows),
        "targets": {"h2d_vs_torch": 0.95, "d2h_vs_torch": 0.95, "bidir_vs_one_way": 1.6},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
