"""hytrain's CPU AdamW step against torch.optim.AdamW(fused=True) on the CPU doing the same work on the
same number of parameters with the same threads.

  fp32  : fp32 gradients in, fp32 state updated.
  mixed : bf16 gradients in, bf16 weight copy out. torch must cast the gradients to fp32, step, then
          cast the weights to bf16 (three passes); hytrain does it in one.

Both move 28 bytes per parameter in the fp32 case; in the mixed case hytrain moves 28 and torch 40
(+6 for the casts' reads and writes), so the floor ratio there is about 1.4 before write-allocate
traffic, which torch's out-of-place casts also pay. bandwidth_fraction is hytrain's achieved GB/s
(the lower of the two cases) over the STREAM triad measured in the same run (and, for reference, over
an in-place update probe, which pays no write-allocate reads).

Compact states (mixed case, fp32 master): bf16 m and v move 20 bytes per parameter, 8-bit m and v
about 16 (one code byte each way per moment, a scale per 256 elements); each is reported as GB/s of
those bytes over the same triad (``bf16_states_fraction``, ``q8_fraction``): 1 is the host's floor.

One process against several (``--processes``, hytrain.host_rate): the optimizer's update in pool
memory from one process with every core, then from 2 and 4 processes at once, each bound to its share
of a NUMA node's CPUs; and one process with the pool's pages spread over the NUMA nodes (the default)
against left where the slab's maker ran (``HYTRAIN_PAGE_PLACEMENT=local``). ``one_process_fraction``
is one process's rate over the best of them: what a one-GPU run leaves of the host.

Ends with one JSON line: mixed_vs_torch, fp32_vs_torch (>1: hytrain faster), bandwidth_fraction,
the compact states' fractions.

  python bench/cpu_adam.py [--params N] [--threads T] [--repeats R] [--processes 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hytrain

BYTES_PER_PARAM = 28.0


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=128 * 2**20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--processes", default="1,2,4",
                    help="process counts for the one-against-several comparison ('' to skip)")
    args = ap.parse_args()
    n, threads = args.params, args.threads
    torch.set_num_threads(threads)
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    gen = torch.Generator().manual_seed(0)
    g32 = torch.randn(n, generator=gen) * 1e-3
    g16 = g32.to(torch.bfloat16)

    # torch: fp32 master parameter with an fp32 .grad buffer; fused AdamW.
    tp = torch.nn.Parameter(torch.randn(n, generator=gen))
    tp.grad = g32.clone()
    topt = torch.optim.AdamW([tp], fused=True, **hp)
    w16 = torch.empty(n, dtype=torch.bfloat16)
    step_torch_fp32 = topt.step

    def step_torch_mixed():
        tp.grad.copy_(g16)   # cast bf16 gradients to fp32
        topt.step()
        w16.copy_(tp.detach())  # cast the weights to bf16 for the GPU

    # hytrain: the same state, one fused pass.
    hp_ = tp.detach().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=torch.bfloat16)
    state = {"step": 0}

    def step_ours(grad, out):
        state["step"] += 1
        hytrain.adamw_step(hp_, grad, m, v, step=state["step"], lr=hp["lr"], betas=hp["betas"],
                           eps=hp["eps"], weight_decay=hp["weight_decay"], param_copy=out,
                           num_threads=threads)

    with torch.no_grad():
        t_torch_fp32 = median_time(step_torch_fp32, args.repeats)
        t_torch_mixed = median_time(step_torch_mixed, args.repeats)
    t_ours_fp32 = median_time(lambda: step_ours(g32, None), args.repeats)
    t_ours_mixed = median_time(lambda: step_ours(g16, copy), args.repeats)
    del tp, topt, g32, m, v

    # 8-bit states on the selected path ("8bit") and the next vector path down (avx512vbmi's permute
    # decoder and its vendor's encoder, q8_encoder(), against avx512's gathers).
    paths = hytrain.simd_paths()
    q8_paths = [p for p in ("avx512", "avx2") if p in paths["supported"] and p != paths["selected"]][:1]
    compact = {}
    for fmt in ["bf16", "8bit"] + [f"8bit:{p}" for p in q8_paths]:
        if fmt == "bf16":
            cm, cv = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        else:
            cm, cv = (torch.zeros(hytrain.quant8.state_bytes(n), dtype=torch.uint8) for _ in range(2))
        cstate = {"step": 0}

        def step_compact(cm=cm, cv=cv, cstate=cstate):
            cstate["step"] += 1
            hytrain.adamw_step(hp_, g16, cm, cv, step=cstate["step"], lr=hp["lr"], betas=hp["betas"],
                               eps=hp["eps"], weight_decay=hp["weight_decay"], param_copy=copy,
                               num_threads=threads, simd=fmt.partition(":")[2] or "auto")

        compact[fmt] = median_time(step_compact, args.repeats)
        del cm, cv

    # Bandwidth over the fp32 case's footprint: three arrays, 16 bytes per parameter in all.
    bw = hytrain.native().measure_host_bandwidth(n * 4 // 3, threads, args.repeats)
    a, b, c = (torch.ones(n * 4 // 3) for _ in range(3))
    t_triad = median_time(lambda: torch.add(b, c, alpha=1.0001, out=a), args.repeats)
    torch_triad = 12 * a.numel() / t_triad / 1e9
    triad = max(bw["triad_gbps"], torch_triad)

    q8_bytes = 8 + 2 + 2 + 2 * 2 * hytrain.quant8.state_bytes(n) / n  # master r+w, grad, weight, m and v r+w
    rows = [("torch fp32", t_torch_fp32, 28), ("hytrain fp32", t_ours_fp32, 28),
            ("torch mixed", t_torch_mixed, 40), ("hytrain mixed", t_ours_mixed, 28),
            ("hytrain bf16 m,v", compact["bf16"], 20), ("hytrain 8-bit m,v", compact["8bit"], q8_bytes)]
    rows += [(f"8-bit on {p}", compact[f"8bit:{p}"], q8_bytes) for p in q8_paths]
    info = hytrain.build_info()
    print(f"CPU AdamW, {n / 1e6:.0f} M params, {threads} threads, SIMD {info['simd_selected']}")
    print(f"host bandwidth: triad {bw['triad_gbps']:.1f} GB/s (native), {torch_triad:.1f} GB/s (torch); "
          f"in-place update {bw['update_gbps']:.1f} GB/s; copy {bw['copy_gbps']:.1f} GB/s")
    print(f"{'':18s} {'ms/step':>9s} {'Gparam/s':>9s} {'GB/s':>7s} {'B/param':>8s}")
    for name, t, bpp in rows:
        print(f"{name:18s} {t * 1e3:9.2f} {n / t / 1e9:9.3f} {bpp * n / t / 1e9:7.1f} {bpp:8.2f}")

    achieved = BYTES_PER_PARAM * n / max(t_ours_fp32, t_ours_mixed) / 1e9
    result = {
        "bench": "cpu_adam",
        "params": n,
        "threads": threads,
        "simd": info["simd_selected"],
        "fp32_vs_torch": round(t_torch_fp32 / t_ours_fp32, 3),
        "mixed_vs_torch": round(t_torch_mixed / t_ours_mixed, 3),
        "bandwidth_fraction": round(achieved / triad, 3),
        "update_fraction": round(achieved / bw["update_gbps"], 3),
        "hytrain_gparams_per_s": round(n / t_ours_mixed / 1e9, 3),
        "triad_gbps": round(triad, 1),
        "bf16_states_gbps": round(20 * n / compact["bf16"] / 1e9, 1),
        "bf16_states_fraction": round(20 * n / compact["bf16"] / 1e9 / triad, 3),
        "q8_gbps": round(q8_bytes * n / compact["8bit"] / 1e9, 1),
        "q8_fraction": round(q8_bytes * n / compact["8bit"] / 1e9 / triad, 3),
        "q8_vs_bf16_states": round(compact["bf16"] / compact["8bit"], 3),
        "q8_gparams_per_s": round(n / compact["8bit"] / 1e9, 3),
    }
    for p in q8_paths:  # the selected path's 8-bit rate over this one's
        result[f"q8_vs_{p}"] = round(compact[f"8bit:{p}"] / compact["8bit"], 3)
    if args.processes:
        result.update(one_against_several(n, args.repeats, [int(c) for c in args.processes.split(",")]))
    print(json.dumps(result))


def one_against_several(n: int, passes: int, counts: list[int]) -> dict:
    """One process's update rate (pool memory, both page placements) and several processes' at once."""
    import os

    from hytrain import host_rate

    saved = os.environ.get("HYTRAIN_PAGE_PLACEMENT")
    rates = {}
    try:
        for placement in ("local", "spread"):
            os.environ["HYTRAIN_PAGE_PLACEMENT"] = placement
            rates[placement] = host_rate.processes_rate(1, n, passes)["gparams_per_s"]
    finally:
        os.environ.pop("HYTRAIN_PAGE_PLACEMENT", None) if saved is None else os.environ.update(
            HYTRAIN_PAGE_PLACEMENT=saved)
    several = host_rate.compare(n, passes, counts)
    best = max(several["best_gparams_per_s"], rates["spread"])
    print(f"one process: {rates['spread']:.3f} G params/s with pages spread, {rates['local']:.3f} left local; "
          + ", ".join(f"{r['processes']} x {r['threads_per_process']} threads: {r['gparams_per_s']:.3f}"
                      for r in several["rates"]))
    return {"nodes": hytrain.pool.page_placement()["nodes"],
            "one_process_gparams_per_s": rates["spread"], "one_process_local_gparams_per_s": rates["local"],
            "processes_gparams_per_s": {r["processes"]: r["gparams_per_s"] for r in several["rates"]},
            "one_process_fraction": round(rates["spread"] / best, 3)}


if __name__ == "__main__":
    main()
