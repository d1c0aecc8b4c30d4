"""The host's CPU AdamW update rate, from one process and from several at once.

What one process reaches is what a one-GPU run gets; what several reach together (each on its own
parameters, bound to its share of a NUMA node's CPUs, as the job's ranks are) is what the host can do.
The update here is the optimizer's: fp32 master, m and v in pool memory (placed as new pool slabs are,
see ``hytrain_native.page_placement()``), a bf16 gradient in and a bf16 weight copy out, 28 bytes per
parameter.

  python -m hytrain.host_rate [--params N] [--passes K] [--processes 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BYTES_PER_PARAM = 28  # fp32 p, m, v read and written; bf16 gradient read; bf16 copy written


def _buffers(params: int):
    import torch

    from .pool import PinnedPool

    # The pool's page placement, no pinning. Its capacity: the 16 B a parameter, and for each of the
    # five buffers a slab's worth of what the slabs leave over (a buffer of a slab or more takes its
    # own, rounded up; the smaller ones share slabs).
    slab = 256 << 20
    pool = PinnedPool(params * 16 + 5 * slab, slab_bytes=slab, pinned=False)
    p, m, v = (pool.empty(params) for _ in range(3))
    g, copy = pool.empty(params, torch.bfloat16), pool.empty(params, torch.bfloat16)
    p.copy_(torch.randn(params))
    m.zero_(), v.zero_(), copy.zero_()
    g.copy_(torch.randn(params) * 1e-3)
    return pool, p, g, m, v, copy


def update_interval(params: int, passes: int, threads: int, ready=None) -> tuple[float, float]:
    """The wall-clock interval (``time.time()`` at its start and end) of ``passes`` optimizer updates
    of ``params`` parameters on ``threads`` threads, in this process, after one untimed pass (threads
    up, pages warm); ``ready()``, when given, is called then and returns when the timed passes may
    start (several processes' barrier)."""
    from .cpu_adam import adamw_step

    _pool, p, g, m, v, copy = _buffers(params)
    adamw_step(p, g, m, v, step=1, param_copy=copy, num_threads=threads)
    if ready is not None:
        ready()
    t0 = time.time()
    for i in range(passes):
        adamw_step(p, g, m, v, step=2 + i, param_copy=copy, num_threads=threads)
    return t0, time.time()


def update_seconds(params: int, passes: int, threads: int) -> float:
    """Seconds ``passes`` optimizer updates of ``params`` parameters take on ``threads`` threads."""
    t0, t1 = update_interval(params, passes, threads)
    return t1 - t0


def _worker(args) -> None:
    from .distributed import default_workers, numa_nodes, rank_cpus

    # Spread evenly over the nodes (whatever GPUs there are): the host's best, not one job's layout.
    allowed = set(os.sched_getaffinity(0))
    cpus = rank_cpus(args.rank, args.world, numa_nodes(), allowed, [])
    if set(cpus) != allowed:
        os.sched_setaffinity(0, cpus)
    threads = default_workers()
    t0, t1 = update_interval(args.params, args.passes, threads, barrier)
    print(json.dumps({"start": t0, "end": t1, "threads": threads, "cpus": len(cpus)}), flush=True)


def barrier() -> None:
    """A worker's side of run_together's barrier: says it is ready, waits for the word to go."""
    print("ready", flush=True)
    sys.stdin.readline()


def run_together(cmds: list[list[str]], env: dict, timeout: float = 600.0) -> list[dict]:
    """Starts the worker commands, lets them go at once when every one is ready (each calls
    barrier()), and returns the JSON each prints last."""
    procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for c in cmds]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a host-rate worker stopped before it was ready (status {p.wait(timeout)})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        runs = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"a host-rate worker exited with status {p.returncode}")
            runs.append(json.loads(out.strip().splitlines()[-1]))
        return runs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def together(runs: list[dict], work: float) -> tuple[float, bool]:
    """``work`` over the span from the first start to the last end of ``runs`` (never more than their
    sum would give, should they not overlap), and whether they all ran at once: every start before
    every end."""
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return work / span, max(r["start"] for r in runs) < min(r["end"] for r in runs)


def processes_rate(processes: int, params: int, passes: int, timeout: float = 600.0) -> dict:
    """The update rate of ``processes`` processes updating at once, each its own ``params``
    parameters with its share of the CPUs (bound as the job's ranks are): parameters per second and
    bytes per second, all processes together."""
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(processes), OMP_NUM_THREADS="1")
    runs = run_together([[sys.executable, "-m", "hytrain.host_rate", "--worker", "--rank", str(r), "--world",
                          str(processes), "--params", str(params), "--passes", str(passes)]
                         for r in range(processes)], env, timeout)
    rate, at_once = together(runs, processes * params * passes)
    return {"processes": processes, "threads_per_process": runs[0]["threads"], "at_once": at_once,
            "gparams_per_s": round(rate / 1e9, 3), "gbps": round(BYTES_PER_PARAM * rate / 1e9, 1)}


def compare(params: int, passes: int, counts=(1, 2, 4)) -> dict:
    """One process against several: each count's rate, the best, and one process's fraction of it."""
    rates = [processes_rate(n, params, passes) for n in sorted(set(counts) | {1})]
    one = rates[0]["gparams_per_s"]
    best = max(rates, key=lambda r: r["gparams_per_s"])
    return {"rates": rates, "one_process_gparams_per_s": one, "best_gparams_per_s": best["gparams_per_s"],
            "best_processes": best["processes"], "one_process_fraction": round(one / best["gparams_per_s"], 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=64 * 2**20, help="parameters per process")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--processes", default="1,2,4", help="process counts to compare")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    print(json.dumps(compare(args.params, args.passes, [int(c) for c in args.processes.split(",")])))


if __name__ == "__main__":
    main()
