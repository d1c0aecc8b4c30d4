"""Why one process updates at a fraction of what several processes reach together: the optimizer's CPU
update (fp32 master, m, v; bf16 gradient in, bf16 weight out; 28 bytes a parameter) in one process
under variations, each timed over the same parameters, beside the same update from several processes
(hytrain.host_rate). Prints one line per variation and one JSON line.

  threads T        one OpenMP team of T threads (the thread-count curve: where it flattens)
  touch=team       the pages first touched by the updating team itself (torch's parallel zero_),
                   not by the one thread that made the pool slab
  teams=K          K teams of T/K threads at once (Python threads, the GIL released), each on its own
                   1/K of the parameters: one process, K independent updates
  processes=K      K processes of T/K threads at once, each on its own memory (hytrain.host_rate)
  shared=K         K processes of T/K threads at once on one set of pages (files in /dev/shm mapped
                   by each), each its 1/K: several address spaces, the same memory

Also reports the machine facts that bear on it: NUMA nodes, transparent huge pages, the cgroup's CPU
quota, the CPUs this process may use.

  python bench/host_probe.py [--params N] [--passes K]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

import hytrain
from hytrain import host_rate
from hytrain.distributed import default_workers


def facts() -> dict:
    def read(path):
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    return {"cpus": len(os.sched_getaffinity(0)), "nodes": hytrain.pool.page_placement()["nodes"],
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "cpu_max": read("/sys/fs/cgroup/cpu.max"), "numa_balancing": read("/proc/sys/kernel/numa_balancing")}


def buffers(n: int, touch: str):
    if touch == "pool":
        return host_rate._buffers(n)[1:]
    p, m, v = (torch.empty(n) for _ in range(3))
    g, copy = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for t in (p, m, v, g, copy):
        t.zero_()  # torch's intra-op threads: each touches its own range first
    p.copy_(torch.randn(n))
    g.copy_(torch.randn(n) * 1e-3)
    return p, g, m, v, copy


def rate(n: int, passes: int, threads: int, teams: int = 1, touch: str = "pool") -> float:
    """Parameters per second: ``teams`` teams of ``threads // teams`` threads, each on n/teams."""
    share = n // teams
    sets = [buffers(share, touch) for _ in range(teams)]
    per_team = max(1, threads // teams)

    def run(bufs, step0, count):
        p, g, m, v, copy = bufs
        for i in range(count):
            hytrain.adamw_step(p, g, m, v, step=step0 + i, param_copy=copy, num_threads=per_team)

    for bufs in sets:
        run(bufs, 1, 1)  # threads up, pages warm
    workers = [threading.Thread(target=run, args=(bufs, 2, passes)) for bufs in sets]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return share * teams * passes / (time.perf_counter() - t0)


def _shared_files(n: int, directory: str) -> list[str]:
    names = []
    for name, dtype, fill in (("p", torch.float32, 1), ("g", torch.bfloat16, 1e-3), ("m", torch.float32, 0),
                              ("v", torch.float32, 0), ("copy", torch.bfloat16, 0)):
        path = os.path.join(directory, f"hytrain_probe_{os.getpid()}_{name}")
        t = torch.from_file(path, shared=True, size=n, dtype=dtype)
        t.copy_(torch.randn(n) * fill) if fill else t.zero_()
        names.append(path)
    return names


def _shared_worker(args) -> None:
    k, r = args.shared_k, args.shared_rank
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    full = [torch.from_file(f, shared=True, size=args.params, dtype=d) for f, d in zip(args.files.split(","), dtypes)]
    lo, hi = r * args.params // k, (r + 1) * args.params // k
    p, g, m, v, copy = (t[lo:hi] for t in full)
    threads = max(1, default_workers() // k)
    hytrain.adamw_step(p, g, m, v, step=1, param_copy=copy, num_threads=threads)
    host_rate.barrier()
    t0 = time.time()
    for i in range(args.passes):
        hytrain.adamw_step(p, g, m, v, step=2 + i, param_copy=copy, num_threads=threads)
    print(json.dumps({"start": t0, "end": time.time()}), flush=True)


def shared_rate(n: int, passes: int, k: int) -> float:
    """K processes updating one set of shared pages, each its 1/K, at once: parameters per second."""
    import shutil
    import sys

    directory = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 20 * n else "/tmp"
    files = _shared_files(n, directory)
    try:
        cmd = [sys.executable, __file__, "--shared-worker", "--params", str(n), "--passes", str(passes),
               "--files", ",".join(files), "--shared-k", str(k)]
        runs = host_rate.run_together([cmd + ["--shared-rank", str(r)] for r in range(k)],
                                      dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        for f in files:
            os.unlink(f)
    return host_rate.together(runs, n * passes)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=128 * 2**20)
    ap.add_argument("--passes", type=int, default=5)
    for flag, kind in (("--shared-worker", "store_true"), ("--files", None),
                       ("--shared-k", int), ("--shared-rank", int)):
        ap.add_argument(flag, **({"action": kind} if kind == "store_true" else {"type": kind} if kind else {}),
                        help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shared_worker:
        return _shared_worker(args)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    n, passes, threads = args.params, args.passes, default_workers()
    out = {"facts": facts(), "params": n, "threads": threads}
    print(json.dumps(out["facts"]))
    curve = {}
    for t in sorted({1, 2, 4, 8, 16, 32, threads}):
        if t <= threads:
            curve[t] = round(rate(n, passes, t) / 1e9, 3)
            print(f"threads {t:3d}: {curve[t]:.3f} G params/s", flush=True)
    out["threads_curve"] = curve
    out["touch_team"] = round(rate(n, passes, threads, touch="team") / 1e9, 3)
    print(f"touch=team, {threads} threads: {out['touch_team']:.3f}", flush=True)
    for k in (2, 4):
        out[f"teams_{k}"] = round(rate(n, passes, threads, teams=k) / 1e9, 3)
        print(f"teams={k} x {max(1, threads // k)} threads: {out[f'teams_{k}']:.3f}", flush=True)
    for k in (1, 2, 4):
        r = host_rate.processes_rate(k, n // k, passes)
        out[f"processes_{k}"] = r["gparams_per_s"]
        print(f"processes={k} x {r['threads_per_process']} threads: {r['gparams_per_s']:.3f}"
              f"{'' if r['at_once'] else ' (not at once)'}", flush=True)
    for k in (1, 2, 4):
        out[f"shared_{k}"] = round(shared_rate(n, passes, k) / 1e9, 3)
        print(f"shared={k} x {max(1, threads // k)} threads: {out[f'shared_{k}']:.3f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
