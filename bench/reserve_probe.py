"""How fast this host makes the optimizer's host memory, and what slows it: the pool's reservation
(`PinnedPool.reserve_for`, the first part of `state_made_s`) timed alone and under the conditions a
training process adds, one after another in one process:

  ordinary     --gb GB of ordinary memory (the streamed blocks' states), on --threads threads
  pinned       --pinned-gb GB page-locked (as a streamed model's homes are), on 16 threads (CUDA only)
  ordinary     the same as the first, now beside the page-locked memory and an initialised CUDA context
  small_slabs  the same in slabs half as large (--slab-gb / 2: the job's with 8-bit states)
  in_backward  the same, from inside a backward (a gradient hook: where the job's first step makes it)
  fewer_threads  small_slabs on a quarter of the threads
  busy_gpu     the same, while another thread keeps the GPU busy with matmuls (as the first backward does)
  busy_cpu     the same, while --spin threads spin on the CPU (as waiting workers may)

Each line: `PROBE {json}` with the seconds, GB/s, the memory free before, and what the kernel did
meanwhile (pool.memory_counters: huge pages given or not, direct reclaim, compaction). Every pool is
released before the next part. The page cache is left as it is: run it where the job would run (the
device stage runs it after writing the job's checkpoint) to see the job's conditions."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

from hytrain import PinnedPool
from hytrain.pool import counter_changes, memory_counters

GB = 10**9


def reserve(gb: float, threads: int, pinned: bool, slab_gb: float) -> dict:
    slab = int(slab_gb * GB) // (2 << 20) * (2 << 20)
    n = max(1, int(gb * GB) // slab)
    pool = PinnedPool(n * slab + slab, slab_bytes=slab, pinned=pinned)
    before = memory_counters()
    t0 = time.perf_counter()
    got = pool.reserve_for([slab] * n, threads=threads)
    s = time.perf_counter() - t0
    after = memory_counters()
    del pool
    return {"gb": round(got / GB, 1), "s": round(s, 2), "gb_per_s": round(got / GB / s, 1), "threads": threads,
            "free_gb_before": before.get("free_gb"), "cached_gb_before": before.get("cached_gb"),
            "kernel": counter_changes(before, after)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=128.0, help="ordinary memory reserved each time")
    ap.add_argument("--pinned-gb", type=float, default=60.0, help="page-locked memory held from the second part on")
    ap.add_argument("--threads", type=int, default=min(64, len(os.sched_getaffinity(0))))
    ap.add_argument("--slab-gb", type=float, default=6.0, help="slab size (the job's: one layer's state)")
    ap.add_argument("--spin", type=int, default=None, help="spinning threads in busy_cpu (default: --threads)")
    args = ap.parse_args(argv)

    def report(part, rec):
        print("PROBE " + json.dumps({"part": part, **rec}), flush=True)

    report("ordinary", reserve(args.gb, args.threads, False, args.slab_gb))
    if not torch.cuda.is_available():
        return 0
    torch.cuda.init()
    held = PinnedPool(int(args.pinned_gb * GB) + (1 << 30), slab_bytes=1 << 30, pinned=True)
    t0 = time.perf_counter()
    got = held.reserve_for([1 << 30] * int(args.pinned_gb * GB / (1 << 30)))
    report("pinned", {"gb": round(got / GB, 1), "s": round(time.perf_counter() - t0, 2),
                      "gb_per_s": round(got / GB / (time.perf_counter() - t0), 1), "threads": 16})
    report("ordinary", reserve(args.gb, args.threads, False, args.slab_gb))
    # As the job's first step makes it: smaller slabs (one 8-bit layer's state), then from inside a
    # backward (the autograd engine's device thread, where the state is made), then on fewer threads.
    report("small_slabs", reserve(args.gb, args.threads, False, args.slab_gb / 2))
    inside = {}

    def hook(grad):
        inside.update(reserve(args.gb, args.threads, False, args.slab_gb / 2), cpus=len(os.sched_getaffinity(0)))
        return grad

    x = torch.ones(4, device="cuda", requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    report("in_backward", inside)
    report("fewer_threads", reserve(args.gb, max(1, args.threads // 4), False, args.slab_gb / 2))

    stop = threading.Event()

    def gpu_busy():
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    worker = threading.Thread(target=gpu_busy, daemon=True)
    worker.start()
    time.sleep(1.0)
    report("busy_gpu", reserve(args.gb, args.threads, False, args.slab_gb))
    stop.set()
    worker.join()
    # Spinning processes (a spinning thread here would hold the interpreter's lock, not a core).
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spin or args.threads)]
    try:
        time.sleep(1.0)
        report("busy_cpu", reserve(args.gb, args.threads, False, args.slab_gb))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
