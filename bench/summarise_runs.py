"""Prints the runs of a benchmark log (one JSON record a line, as train_bench.py, scale_bench.py and
capacity_bench.py print them) as one line each: wall-clock tokens/s over the timed window and its
ratio to the log's first run, the median, mean, p90 and slowest iteration, every iteration from the
first (the settling phase, untimed ones included), and the cores the CPU update threads kept busy.

    python bench/summarise_runs.py LOG [LOG ...]"""

from __future__ import annotations

import json
import sys


def records(path):
    out = []
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("{") and '"mode"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def line(rec, ref_tps):
    if "error" in rec or "skipped" in rec:
        return f"{rec.get('mode')}: {rec.get('error') or rec.get('skipped')}"
    tps = rec.get("wall_tokens_per_s")
    ratio = f" ({tps / ref_tps:.2f}x)" if tps and ref_tps else ""
    f = lambda k: f"{rec[k]:.3f}" if isinstance(rec.get(k), (int, float)) else "-"  # noqa: E731
    upd = (rec.get("thread_cpu") or {}).get("hytrain-update", {}).get("cores")
    its = rec.get("iter_times_s") or []
    return (f"{rec['mode']} tokens/step {rec.get('tokens_per_step', '-')}: wall {tps and round(tps)} tok/s{ratio}; "
            f"median {f('iter_s_median')} mean {f('iter_s_mean')} p90 {f('iter_s_p90')} max {f('iter_s_max')} s; "
            f"warmup {rec.get('warmup')} k {rec.get('k')} peak reserved {f('peak_gpu_reserved_gb')} GB"
            + (f"; update threads {upd} cores" if upd is not None else "")
            + f"\n    iterations {[round(t, 3) for t in its]}"
            + (f"\n    step() {rec['step_call_s']}" if rec.get("step_call_s") else "")
            + (f"\n    shadows made (blocks, s) {rec['shadow_allocations']}" if rec.get("shadow_allocations") else "")
            + (f"\n    speculation from {rec['speculative_from_per_iteration']}"
               f"\n    shadow allocations so far {rec['shadow_allocations_per_iteration']}"
               if rec.get("speculative_from_per_iteration") else "")
            + (f"\n    shadows locked at the first step (blocks, s) {rec['shadows_ahead']}" if rec.get("shadows_ahead") else "")
            + (f"\n    shadow pool work per iteration (s) {rec['shadow_pool_work_per_iteration']}"
               if any(rec.get("shadow_pool_work_per_iteration") or ()) else "")
            + "".join(f"\n    rank {i}: iterations {r.get('iter_s')}\n      step() {r.get('step_call_s')}"
                      f"\n      k {r.get('k')}\n      speculation from {r.get('speculative_from')}"
                      f"\n      gradient norm {r.get('grad_norm')}"
                      for i, r in enumerate(rec.get("per_rank_iterations") or ())))


def main(paths):
    for path in paths:
        recs = records(path)
        ref = next((r.get("wall_tokens_per_s") for r in recs if r.get("wall_tokens_per_s")), None)
        print(f"== {path}")
        for rec in recs:
            print("  " + line(rec, ref))


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
